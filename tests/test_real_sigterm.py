"""Issue 27, item 5, on the real model: two verifiers on Qwen2.5-Coder 0.5B (the ik engine, exact per session) and an
n-gram drafter; the verifier serving a generation is SIGKILLed mid-generation, the other takes over and the output is
the fault-free run's; then the survivor, idle, and the drafter end on SIGTERM within seconds and log the signal.
(tests/chaos/test_sigterm_after_failover.py runs the same steps with tiny models.)"""

from __future__ import annotations

import signal

import pytest

from coordinator import Coordinator, GenerationOptions
from coordinator.fleet.resilience import ResilienceConfig
from specmesh.runtime.catalog import DEFAULT_DRAFT_MODEL
from specmesh.runtime.engine import ik_available
from tests.chaos.conftest import once, running_fleet
from tests.chaos.test_sigterm_after_failover import DEFAULT_GRACE, sigterm_and_time

pytestmark = [pytest.mark.real_models, pytest.mark.network,  # the GGUF comes from PyPI on first use
              pytest.mark.skipif(not ik_available(), reason="ik_llama.cpp does not load here")]

PROMPT = "Write a Python function that checks whether a number is prime."
OPTIONS = GenerationOptions(max_new_tokens=32)
RESILIENCE = ResilienceConfig(verify_timeout_s=30.0, propose_timeout_s=10.0, retry_budget_s=60.0,
                              backoff_initial_s=0.05, backoff_max_s=0.5, breaker_fail_max=1, breaker_reset_s=0.5)


def test_real_survivor_ends_on_sigterm_after_a_failover():
    with running_fleet(target=DEFAULT_DRAFT_MODEL, draft=DEFAULT_DRAFT_MODEL, dtype="auto", engine="ik",
                       extra=("--max-context-length", "2048", *DEFAULT_GRACE), load_timeout_s=300) as fleet:
        v1, v2 = fleet.start("verifier", wait=False), fleet.start("verifier", wait=False)
        drafter = fleet.start("drafter", extra=("--method", "ngram"), wait=False)
        for worker in (v1, v2, drafter):
            worker.wait_serving(300)
        with Coordinator([v1.address, v2.address], drafter.address, resilience=RESILIENCE) as coordinator:
            reference = coordinator.generate(PROMPT, OPTIONS)
            killed = []

            def kill_the_busy_verifier() -> None:
                address = next(e.address for e in coordinator.verifiers.endpoints if e.sessions > 0)
                killed.append(next(w for w in (v1, v2) if w.address == address))
                killed[-1].kill()

            result = coordinator.generate(PROMPT, OPTIONS, on_text=once(kill_the_busy_verifier, after_calls=2))
            assert killed and killed[0].process.returncode == -signal.SIGKILL
            assert result.stats["failovers"] >= 1
            assert result.token_ids == reference.token_ids  # ik: every pass equals one-token decoding
            survivor = v2 if killed[0] is v1 else v1
            took = sigterm_and_time(survivor)
        print(f"survivor exited {took:.2f} s after SIGTERM")
        log = survivor.log_tail(40)
        assert "received SIGTERM (serving, 0 calls in flight" in log and "verifier stopped in" in log, log
        took = sigterm_and_time(drafter)
        print(f"drafter exited {took:.2f} s after SIGTERM")
        assert "received SIGTERM" in drafter.log_tail(40)
