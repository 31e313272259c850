"""Hung verifiers: one that stops answering with its connection open (SIGSTOP) and one whose health says SERVING
while its Verify calls time out. Deadlines fail the generation over within the retry budget, with output identical to
the fault-free run; keepalive marks the stopped one NOT_SERVING; the breaker takes the slow one out of rotation."""

from __future__ import annotations

import os
import signal
import time

from coordinator import Coordinator, GenerationOptions
from coordinator.fleet.resilience import ResilienceConfig
from tests.chaos.conftest import MAX_NEW, once, poll
from tests.chaos.test_faults import opened, pinned
from verifier.service import run_server as run_verifier

GREEDY = GenerationOptions(max_new_tokens=MAX_NEW, draft_tokens=3)


def test_sigstopped_verifier_is_failed_over_by_deadline_and_noticed_by_keepalive(fleet, tiny, prompt, expected):
    v1, v2, drafter = fleet.start("verifier"), fleet.start("verifier"), fleet.start("drafter")
    # Short keepalive (the workers allow a ping every 5 s) so that the test sees it within seconds.
    config = ResilienceConfig(verify_timeout_s=1.5, propose_timeout_s=1.5, retry_budget_s=20.0,
                              backoff_initial_s=0.05, backoff_max_s=0.5, breaker_fail_max=1, breaker_reset_s=60.0,
                              keepalive_time_s=5.0, keepalive_timeout_s=2.0)
    stopped = []

    def stop_pinned() -> None:
        worker = fleet.by_address(pinned(c))
        os.kill(worker.process.pid, signal.SIGSTOP)  # alive, connection open, never answers
        stopped.append(worker)

    try:
        with Coordinator([v1.address, v2.address], drafter.address, tokenizer=tiny.tokenizer, resilience=config) as c:
            started = time.monotonic()
            result = c.generate(list(prompt), GREEDY, on_text=once(stop_pinned))
            elapsed = time.monotonic() - started
            assert stopped, "the verifier was never stopped"
            address = stopped[0].address
            assert result.token_ids == expected
            assert result.stats["failovers"] >= 1
            assert elapsed < config.retry_budget_s, f"failover took {elapsed:.1f} s"
            assert opened(c, address), c.breaker_transitions  # the deadline counted against its breaker
            # Keepalive: no answer to a ping within keepalive_time_s + keepalive_timeout_s ends the connection, and
            # with it the health stream, although the process is alive and its port open.
            poll(lambda: c.verifiers.health_log[(address, "NOT_SERVING")] >= 1,
                 timeout_s=config.keepalive_time_s + config.keepalive_timeout_s + 10, what="keepalive NOT_SERVING")
            endpoint = next(e for e in c.verifiers.endpoints if e.address == address)
            assert not endpoint.serving
            # The next generation goes straight to the live verifier.
            again = c.generate(list(prompt), GREEDY)
            assert again.token_ids == expected and again.stats["failovers"] == 0 and again.stats["retries"] == 0
    finally:
        for worker in stopped:
            worker.kill()  # SIGKILL ends a stopped process too


def test_serving_verifier_whose_verify_times_out_trips_its_breaker(tiny, prompt, expected):
    # Health says SERVING throughout; from its 5th call on, every Verify waits far past the deadline.
    config = ResilienceConfig(verify_timeout_s=0.5, retry_budget_s=10.0, backoff_initial_s=0.05,
                              backoff_max_s=0.2, breaker_fail_max=2, breaker_reset_s=60.0)
    options = GenerationOptions(max_new_tokens=MAX_NEW, draft_tokens=0)
    with run_verifier(tiny, port=0, inject_latency_s=30.0, slow_after_calls=4) as hung, \
            run_verifier(tiny, port=0) as healthy:
        with Coordinator([hung.address, healthy.address], tokenizer=tiny.tokenizer, resilience=config) as c:
            bad = next(e for e in c.verifiers.endpoints if e.address == hung.address)
            first = c.generate(list(prompt), options)  # starts on the hung one (listed first), turns slow mid-way
            assert first.token_ids == expected and first.stats["failovers"] == 1
            assert bad.breaker.state == "closed"  # one timeout: below breaker_fail_max
            second = c.generate(list(prompt), options)  # placed there again: a second timeout opens the breaker
            assert second.token_ids == expected and second.stats["failovers"] == 1
            assert opened(c, hung.address) and bad.breaker.state == "open"
            third = c.generate(list(prompt), options)  # out of rotation: no deadline to wait for
            assert third.token_ids == expected and third.stats["failovers"] == third.stats["retries"] == 0
            assert bad.serving and c.verifiers.health_log[(hung.address, "NOT_SERVING")] == 0
