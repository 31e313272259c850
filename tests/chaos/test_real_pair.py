"""The verifier-kill and drafter-kill chaos cases on the real default pair (float32, so greedy is exact)."""

from __future__ import annotations

import signal

import pytest

from coordinator import Coordinator, GenerationOptions
from coordinator.resilience import ResilienceConfig
from specmesh.runtime.catalog import DEFAULT_TARGET_MODEL
from tests.chaos.conftest import once

pytestmark = [pytest.mark.real_models, pytest.mark.kills_real_pair]

PROMPT = "Write a Python function that checks whether a number is prime."
# The heuristic keeps drafting, so the drafter is in use when it is killed (the default cost policy may find that
# drafting does not pay on this machine and not call it at all).
OPTIONS = GenerationOptions(max_new_tokens=24, draft_policy="heuristic")
RESILIENCE = ResilienceConfig(verify_timeout_s=60.0, propose_timeout_s=60.0, retry_budget_s=60.0,
                              breaker_fail_max=1, breaker_reset_s=600.0)


@pytest.fixture(scope="module")
def real_fleet(real_pair):
    """The session's real pair (tests/conftest.py) plus a second verifier to fail over to. These tests run last:
    they kill its workers."""
    from coordinator.local_workers import LocalWorker, LocalWorkerSpec
    second = LocalWorker(LocalWorkerSpec("verifier", DEFAULT_TARGET_MODEL, "cpu", "float32"), real_pair.log_dir)
    real_pair.workers.append(second)
    second.wait_serving(timeout_s=900)
    return real_pair


@pytest.fixture(scope="module")
def coordinator(real_fleet):
    verifiers = [w.address for w in real_fleet.workers if w.spec.role == "verifier"]
    drafter = next(w.address for w in real_fleet.workers if w.spec.role == "drafter")
    with Coordinator(verifiers, drafter, resilience=RESILIENCE) as c:
        yield c


@pytest.fixture(scope="module")
def fault_free(coordinator):
    result = coordinator.generate(PROMPT, OPTIONS)
    assert result.stats["failovers"] == 0 and result.stats["degraded_rounds"] == 0
    return result


def test_sigkill_the_pinned_verifier(real_fleet, coordinator, fault_free):
    killed = []

    def kill_pinned() -> None:
        address = next(e.address for e in coordinator.verifiers.endpoints if e.sessions > 0)
        worker = real_fleet.by_address(address)
        worker.kill()
        killed.append(worker)

    result = coordinator.generate(PROMPT, OPTIONS, on_text=once(kill_pinned))
    assert killed and killed[0].process.returncode == -signal.SIGKILL
    assert result.token_ids == fault_free.token_ids
    assert result.stats["failovers"] >= 1


def test_sigkill_the_drafter(real_fleet, coordinator, fault_free):
    drafter = next(w for w in real_fleet.workers if w.spec.role == "drafter")
    result = coordinator.generate(PROMPT, OPTIONS, on_text=once(drafter.kill))
    assert result.token_ids == fault_free.token_ids
    assert result.stats["degraded_rounds"] >= 1
