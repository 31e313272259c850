"""Breaker and retry policy units (no servers)."""

from __future__ import annotations


import grpc
import pytest

from coordinator.fleet.polling import wait_until
from coordinator.fleet.resilience import EndpointBreaker, ResilienceConfig, TransitionLog, is_retryable


def test_breaker_opens_then_lets_exactly_one_probe_through():
    log = TransitionLog()
    breaker = EndpointBreaker("verifier@x", ResilienceConfig(breaker_fail_max=2, breaker_reset_s=0.2), log)
    breaker.record_failure()
    assert breaker.allows_call() and breaker.state == "closed"
    breaker.record_failure()
    assert breaker.state == "open" and not breaker.allows_call()
    assert wait_until(breaker.allows_call, 5.0)  # reset time passed: a probe may go
    breaker.begin_call()
    assert not breaker.allows_call()  # ...but only one while it is in flight
    breaker.record_success()
    assert breaker.state == "closed" and breaker.allows_call()
    assert log.counts[("verifier@x", "closed", "open")] == 1
    assert log.counts[("verifier@x", "open", "half-open")] == 1
    assert log.counts[("verifier@x", "half-open", "closed")] == 1


def test_a_failed_probe_reopens_and_a_lost_probe_goes_stale():
    breaker = EndpointBreaker("drafter@y", ResilienceConfig(breaker_fail_max=1, breaker_reset_s=0.2), TransitionLog())
    breaker.record_failure()
    assert wait_until(breaker.allows_call, 5.0)
    breaker.begin_call()
    breaker.record_failure()
    assert breaker.state == "open" and not breaker.allows_call()
    assert wait_until(breaker.allows_call, 5.0)
    breaker.begin_call()  # a probe that never reports back...
    assert wait_until(breaker.allows_call, 5.0)  # ...stops blocking others after reset_timeout


class _Error(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code


@pytest.mark.parametrize("code, retry", [(grpc.StatusCode.UNAVAILABLE, True), (grpc.StatusCode.DEADLINE_EXCEEDED, True),
                                         (grpc.StatusCode.RESOURCE_EXHAUSTED, True),
                                         (grpc.StatusCode.INVALID_ARGUMENT, False),
                                         (grpc.StatusCode.FAILED_PRECONDITION, False)])
def test_only_transient_errors_are_retried(code, retry):
    assert is_retryable(_Error(code)) is retry


def test_resilience_config_is_validated():
    for bad in (dict(verify_timeout_s=0), dict(retry_budget_s=-1), dict(breaker_fail_max=0),
                dict(backoff_max_s=float("nan"))):
        with pytest.raises(ValueError):
            ResilienceConfig(**bad)


def test_a_call_carrying_a_long_context_gets_a_longer_deadline():
    config = ResilienceConfig(verify_timeout_s=30.0, timeout_per_context_token_s=0.1)
    assert config.attempt_timeout(30.0, 0) == 30.0
    assert config.attempt_timeout(30.0, 900) == pytest.approx(120.0)  # a 900-token prompt's prefill
    with pytest.raises(ValueError, match="timeout_per_context_token_s"):
        ResilienceConfig(timeout_per_context_token_s=-1.0)
