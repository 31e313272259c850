"""A worker's costs, measured in the background after SERVING when they are not cached (specmesh/worker/
cost_probe.py): what Info reports meanwhile, that a request waits for at most one probe call and is answered as
always, that a restart reports the cached costs from its first Info, and that stopping leaves no thread behind."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from coordinator.fleet.worker_client import measures_costs_later
from drafter.engine import DraftEngine
from drafter.service import run_server as run_drafter
from specmesh.ops import metrics
from specmesh.v1 import specmesh_pb2 as pb
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc
from specmesh.wire.history import EMPTY_HASH
from specmesh.worker import cost_probe
from specmesh.worker.cost_probe import read_cached_costs
from specmesh.worker.machine_load import OthersCpu
from tests.helpers import reference_greedy, wait_for_costs
from verifier.engine import VerifyEngine
from verifier.service import run_server as run_verifier

ROLES = {
    # role: (engine class, its probe call on the model thread, server, stub, the metric its passes count in)
    "verifier": (VerifyEngine, "_probe_verify_on_model_thread", run_verifier, pb_grpc.VerifierStub,
                 metrics.VERIFY_BATCH_SIZE),
    "drafter": (DraftEngine, "_probe_propose_on_model_thread", run_drafter, pb_grpc.DrafterStub,
                metrics.DRAFT_BATCH_SIZE),
}
PROBE_CALLS = {"verifier": 1 + 3 * 5, "drafter": 1 + 3}  # the prefill, then 3 runs of each probed draft count


@pytest.fixture(autouse=True)
def cacheable(tmp_path, monkeypatch):
    """An empty cost cache, a cache key for the tiny models (which have no model file of their own to key on), and a
    machine no other process computes on."""
    monkeypatch.setenv("SPECMESH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cost_probe, "cost_cache_key", lambda role, loaded: {"role": role, "model": loaded.name})
    # The calls counted below are made again only where a request came (test_cost_probe.py tests the calls made again
    # because other processes computed; here the other test processes may well).
    monkeypatch.setattr(cost_probe, "OthersCpu", QuietMachine)


class QuietMachine(OthersCpu):
    busy = False


def info(address: str, role: str) -> pb.InfoResponse:
    with grpc.insecure_channel(address) as channel:
        return ROLES[role][3](channel).Info(pb.InfoRequest(), timeout=5)


def reported_costs(reply: pb.InfoResponse):
    if reply.role == "verifier":
        return [[c.drafts, c.seconds] for c in reply.verify_costs]
    return reply.draft_per_token_s


def passes_counted(histogram) -> float:
    return next(s.value for family in histogram.collect() for s in family.samples if s.name.endswith("_count"))


def probe_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.endswith("-cost-probe")]


@pytest.mark.parametrize("role", ROLES)
def test_info_reports_no_costs_at_serving_then_the_measured_ones_and_a_restart_reads_them_back(
        role, tiny_target, monkeypatch):
    monkeypatch.setattr(cost_probe, "QUIET_BEFORE_PROBE_S", 1.0)  # no probe call before the first Info below
    with ROLES[role][2](tiny_target, port=0) as server:
        first = info(server.address, role)
        assert measures_costs_later(first) and reported_costs(first) in ([], 0.0), "SERVING before measuring"
        measured = wait_for_costs(server.address, role)
        costs = reported_costs(measured)
        assert read_cached_costs({"role": role, "model": tiny_target.name}) == costs
        if role == "verifier":
            assert measured.verify_base_s == costs[0][1] and measured.verify_per_draft_s >= 0
            assert [k for k, _ in costs] == list(cost_probe.PROBE_VERIFY_DRAFTS)
    with ROLES[role][2](tiny_target, port=0) as restarted:
        assert reported_costs(info(restarted.address, role)) == costs, "from the first Info"
        assert restarted.engine._cost_probe is None, "nothing measured again"


@pytest.mark.parametrize("role", ROLES)
def test_a_request_during_a_probe_call_waits_for_that_call_only_and_is_answered_as_always(role, tiny_target,
                                                                                          monkeypatch):
    engine_class, probe_call, run, stub_class, histogram = ROLES[role]
    slow_s, in_slow_call, calls = 1.0, threading.Event(), []
    original = getattr(engine_class, probe_call)

    def slow_second_call(self, *args):  # the first timed call holds the model for slow_s
        calls.append(args)
        if len(calls) == 2:
            in_slow_call.set()
            time.sleep(slow_s)
        return original(self, *args)

    monkeypatch.setattr(engine_class, probe_call, slow_second_call)
    prompt = [5, 17, 3, 99, 42, 8]
    continuation = reference_greedy(tiny_target.model, prompt, 4)
    context = pb.ContextSync(base_length=0, base_hash=EMPTY_HASH, new_tokens=prompt)
    with run(tiny_target, port=0) as server, grpc.insecure_channel(server.address) as channel:
        counted = passes_counted(histogram)
        assert in_slow_call.wait(30)
        started = time.monotonic()
        if role == "verifier":
            reply = stub_class(channel).Verify(pb.VerifyRequest(session_id="s", context=context,
                                                                draft_tokens=continuation[:3]), timeout=30)
            assert (reply.accepted, reply.next_token, reply.committed_length) == (3, continuation[3], len(prompt) + 4)
            real_passes = 1
        else:
            reply = stub_class(channel).Propose(pb.ProposeRequest(session_id="s", context=context, num_tokens=3),
                                                timeout=30)
            assert (list(reply.tokens), reply.committed_length) == (continuation[:3], len(prompt))
            real_passes = 3  # one draft step per token
        waited = time.monotonic() - started
        assert waited < slow_s + 0.8, f"waited {waited:.2f} s: more than the one probe call in flight"
        assert not measures_costs_later(wait_for_costs(server.address, role))
        # The call the request arrived during was made again; no probe pass counts as traffic.
        assert len(calls) == PROBE_CALLS[role] + 1
        assert passes_counted(histogram) == counted + real_passes
        assert len(server.engine.sessions) == 1, "the probe's session is not among the served ones"


@pytest.mark.parametrize("role", ROLES)
def test_stopping_while_measuring_leaves_no_thread_behind(role, tiny_target, monkeypatch):
    engine_class, probe_call, *_ = ROLES[role]
    in_call, original = threading.Event(), getattr(engine_class, probe_call)
    thread_errors = []
    monkeypatch.setattr(threading, "excepthook", thread_errors.append)

    def slow_call(self, *args):
        in_call.set()
        time.sleep(0.3)
        return original(self, *args)

    monkeypatch.setattr(engine_class, probe_call, slow_call)
    engine = engine_class(tiny_target)
    engine.warm_up()
    assert in_call.wait(30)
    started = time.monotonic()
    engine.stop_background_work()
    assert time.monotonic() - started < 0.3 + 2.0, "stopped within the probe call in flight"
    assert not engine._cost_probe.thread.is_alive() and engine._cost_probe.thread not in probe_threads()
    assert reported_costs_of(engine) in ((), 0.0), "nothing published"
    assert engine._probe_session is None and thread_errors == []
    engine.stop_background_work()  # again: nothing to do


def reported_costs_of(engine):
    return engine.verify_costs if isinstance(engine, VerifyEngine) else engine.draft_per_token_s
