"""Issue 27, item 5, with tiny models: two verifiers and an n-gram drafter; the verifier serving the generation is
SIGKILLed mid-generation, the other takes over with the same output; then the survivor, idle (the coordinator still
watching its health), and the drafter end on SIGTERM within seconds, saying so in their logs.
tests/test_real_sigterm.py runs the same steps on the real 0.5B model."""

from __future__ import annotations

import signal
import subprocess
import time

from coordinator import Coordinator
from coordinator.fleet.local_workers import LocalWorker
from tests.chaos.conftest import TARGET, once
from tests.chaos.test_faults import FAST, GREEDY, pinned

EXIT_BOUND_S = 10.0
DEFAULT_GRACE = ("--grace", "10")  # the CLI's default (local workers are started with 1)


def sigterm_and_time(worker: LocalWorker) -> float:
    """SIGTERM; seconds until the process has exited (0 expected), killed with a failure if it outlives the bound."""
    started = time.monotonic()
    worker.process.send_signal(signal.SIGTERM)
    try:
        status = worker.process.wait(EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        worker.kill()
        raise AssertionError(f"{worker.spec.role} still running {EXIT_BOUND_S} s after SIGTERM; its log:\n"
                             f"{worker.log_tail(40)}") from None
    assert status == 0, worker.log_tail(40)
    return time.monotonic() - started


def test_survivor_and_drafter_end_on_sigterm_after_a_failover(fleet, tiny, prompt, expected):
    v1, v2 = fleet.start("verifier", extra=DEFAULT_GRACE), fleet.start("verifier", extra=DEFAULT_GRACE)
    drafter = fleet.start("drafter", model=TARGET, extra=("--method", "ngram", *DEFAULT_GRACE))
    with Coordinator([v1.address, v2.address], drafter.address, tokenizer=tiny.tokenizer, resilience=FAST) as c:
        killed: list[LocalWorker] = []
        result = c.generate(list(prompt), GREEDY, on_text=once(lambda: killed.append(fleet.by_address(pinned(c)))
                                                               or killed[-1].kill()))
        assert killed and killed[0].process.returncode == -signal.SIGKILL
        assert result.token_ids == expected and result.stats["failovers"] >= 1
        survivor = v2 if killed[0] is v1 else v1
        took = sigterm_and_time(survivor)  # while the coordinator still holds a health Watch stream open to it
    print(f"survivor exited {took:.2f} s after SIGTERM")
    log = survivor.log_tail(40)
    assert '"received SIGTERM (serving, 0 calls in flight; main thread in serve_on_main_thread' in log, log
    assert "verifier stopped in" in log, log
    took = sigterm_and_time(drafter)
    print(f"drafter exited {took:.2f} s after SIGTERM")
    assert "received SIGTERM" in drafter.log_tail(40)
