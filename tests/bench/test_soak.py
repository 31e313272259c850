"""Leak sampling and the drain of sessions after load (specmesh_bench/soak.py) against live tiny-model
servers: sessions are seen while generations run, and after the load stops they go to zero, both those the
coordinator ends (EndSession) and one a client abandoned (the idle TTL)."""

from __future__ import annotations

import os
import threading

import pytest

from coordinator import Coordinator, GenerationOptions
from specmesh_bench.soak import Sampler, Watched, active_sessions, sample_process, wait_drained
from coordinator.fleet.worker_client import RemoteWorker
from drafter.service import run_server as run_drafter
from specmesh.v1 import specmesh_pb2 as pb
from specmesh.wire.history import EMPTY_HASH
from specmesh.worker.session_store import SessionLimits
from verifier.service import run_server as run_verifier

TTL_S = 2.0


@pytest.fixture(scope="module")
def workers(tiny_target, tiny_unrelated_draft):
    limits = SessionLimits(idle_ttl_s=TTL_S)
    with run_verifier(tiny_target, port=0, limits=limits) as v, \
            run_drafter(tiny_unrelated_draft, port=0, limits=limits) as d:
        yield {"verifier": (v.address, "verifier"), "drafter": (d.address, "drafter")}


def test_sessions_drain_to_zero_after_the_load_stops(workers, tiny_target):
    watched = {role: Watched(os.getpid, address, role) for role, (address, _) in workers.items()}
    with Sampler(watched, interval_s=0.05) as sampler, \
            Coordinator(workers["verifier"][0], workers["drafter"][0], tokenizer=tiny_target.tokenizer) as c:
        started = threading.Barrier(4)

        def generate(i: int) -> None:
            started.wait()
            c.generate(f"def f{i}(x):", GenerationOptions(max_new_tokens=24, draft_tokens=3, chat=False))
        threads = [threading.Thread(target=generate, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        # A client that goes away without EndSession leaves its session to the idle TTL.
        verifier = RemoteWorker(workers["verifier"][0], "verifier")
        prompt = tiny_target.tokenizer("abandoned")["input_ids"]
        verifier.stub.Verify(pb.VerifyRequest(session_id="abandoned", context=pb.ContextSync(
            base_length=0, base_hash=EMPTY_HASH, new_tokens=prompt)), timeout=10)
        verifier.close()
        assert active_sessions(*workers["verifier"]) == 1
        drained_s = wait_drained(workers, timeout_s=TTL_S + 10, interval_s=0.1)
    assert drained_s is not None and drained_s <= TTL_S + 10
    assert all(active_sessions(*worker) == 0 for worker in workers.values())
    summary = sampler.summary()
    assert summary["verifier"]["sessions_max"] >= 1  # the sampler saw sessions while the load ran
    assert summary["drafter"]["sessions_max"] >= 1
    assert summary["verifier"]["pids"] == 1 and summary["verifier"]["rss_first_mb"] > 0


def test_a_gone_process_or_worker_is_none_not_an_error(workers):
    assert sample_process(2**22 + 12345) is None  # above the default pid_max: no such process
    assert active_sessions("127.0.0.1:1", "verifier", timeout_s=0.5) is None
    assert wait_drained({"gone": ("127.0.0.1:1", "verifier")}, timeout_s=0.3, interval_s=0.1) is None
