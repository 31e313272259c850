"""Deadlines, retries and circuit breakers for the coordinator's RPCs.

Retries live here only (tenacity), never in the gRPC channel as well: stacked retry layers multiply attempts.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from dataclasses import dataclass

import grpc
import pybreaker

from coordinator.fleet.channel import CHANNEL_OPTIONS
from specmesh.ops import metrics
from specmesh.wire.contract import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS, MIN_PING_INTERVAL_MS

log = logging.getLogger("specmesh.resilience")

# Worth another attempt (the same or another worker may answer): the worker is gone, slow or overloaded.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                       grpc.StatusCode.RESOURCE_EXHAUSTED})
# Count against a worker's breaker: it failed to serve, as opposed to the request being wrong.
BREAKER_FAILURES = RETRYABLE | {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED}


@dataclass(frozen=True)
class ResilienceConfig:
    """Every knob of the coordinator's fault handling (docs/fault-tolerance.md)."""

    verify_timeout_s: float = 30.0    # deadline of one Verify attempt (one target forward pass + transfer)
    propose_timeout_s: float = 30.0   # deadline of one Propose attempt (k draft forward passes + transfer)
    # A call that carries a long context (a prompt's prefill, a resync of a whole history) gets this much longer per
    # token it carries: a CPU verifier prefills a few hundred tokens a second at best (the 1.5B on ik_llama.cpp, 2
    # cores, in exact passes of 31 tokens: about 70), and a fixed deadline would fail long prompts.
    timeout_per_context_token_s: float = 0.1
    retry_budget_s: float = 30.0      # total time one step may spend retrying before the generation fails
    backoff_initial_s: float = 0.05   # first retry delay; doubles, with jitter, up to backoff_max_s
    backoff_max_s: float = 1.0
    breaker_fail_max: int = 3         # consecutive failures that open a worker's breaker
    breaker_reset_s: float = 5.0      # an open breaker lets one probe through after this long (half-open)
    # A worker that stops answering with its connection open (hung, SIGSTOPped, a half-dead host) is noticed by
    # keepalive pings within keepalive_time_s + keepalive_timeout_s, even with no call in flight: its health then
    # reads NOT_SERVING. Workers refuse pings more often than MIN_PING_INTERVAL_MS.
    keepalive_time_s: float = KEEPALIVE_TIME_MS / 1000
    keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_MS / 1000

    def __post_init__(self) -> None:
        if not (math.isfinite(self.timeout_per_context_token_s) and self.timeout_per_context_token_s >= 0):
            raise ValueError("timeout_per_context_token_s must be a non-negative number of seconds, got "
                             f"{self.timeout_per_context_token_s}")
        for name in ("verify_timeout_s", "propose_timeout_s", "retry_budget_s", "backoff_initial_s",
                     "backoff_max_s", "breaker_reset_s", "keepalive_time_s", "keepalive_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        if self.breaker_fail_max < 1:
            raise ValueError(f"breaker_fail_max must be >= 1, got {self.breaker_fail_max}")
        if self.keepalive_time_s * 1000 < MIN_PING_INTERVAL_MS:
            raise ValueError(f"keepalive_time_s must be >= {MIN_PING_INTERVAL_MS / 1000:g} (workers refuse more "
                             f"frequent pings), got {self.keepalive_time_s}")

    def attempt_timeout(self, base_s: float, context_tokens: int) -> float:
        """The deadline of one attempt of a call that carries `context_tokens` tokens to compute (besides drafts)."""
        return base_s + self.timeout_per_context_token_s * context_tokens

    def channel_options(self) -> list[tuple[str, int]]:
        """The channel options for reaching workers, with this config's keepalive timings."""
        timeout_ms = round(self.keepalive_timeout_s * 1000)
        keepalive = {"grpc.keepalive_time_ms": round(self.keepalive_time_s * 1000),
                     "grpc.keepalive_timeout_ms": timeout_ms, "grpc.http2.ping_timeout_ms": timeout_ms}
        return [(name, keepalive.get(name, value)) for name, value in CHANNEL_OPTIONS]


def is_retryable(error: BaseException) -> bool:
    if isinstance(error, NoWorkerAvailable):
        return True
    return isinstance(error, grpc.RpcError) and error.code() in RETRYABLE


class NoWorkerAvailable(Exception):
    """No healthy worker with a closed (or probing) breaker right now."""


class TransitionLog(pybreaker.CircuitBreakerListener):
    """Logs and counts breaker transitions: counts[(endpoint, old, new)]."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self._lock = threading.Lock()

    def state_change(self, cb, old_state, new_state) -> None:
        old = old_state.name if old_state else "none"
        with self._lock:
            self.counts[(cb.name, old, new_state.name)] += 1
        metrics.BREAKER_TRANSITIONS.labels(cb.name, old, new_state.name).inc()
        log.warning("breaker %s: %s -> %s", cb.name, old, new_state.name)


class _Recorded(Exception):
    """Carries a failed call's outcome into the breaker."""


class EndpointBreaker:
    """A pybreaker breaker used without holding its lock during the real call.

    pybreaker's call() keeps a lock for the whole wrapped call, which would serialise every concurrent generation
    through one endpoint. So the RPC runs outside, and only its outcome is fed through call() with a function that
    returns or raises at once: the lock is held for microseconds and the state machine stays pybreaker's.
    """

    def __init__(self, name: str, config: ResilienceConfig, listener: TransitionLog) -> None:
        self.breaker = pybreaker.CircuitBreaker(fail_max=config.breaker_fail_max,
                                                reset_timeout=config.breaker_reset_s, name=name,
                                                listeners=[listener])
        self._probe_started: float | None = None

    @property
    def state(self) -> str:
        return self.breaker.current_state

    def allows_call(self) -> bool:
        """Closed: yes. Open: only once reset_timeout has passed, and only while no probe is in flight (one caller
        tests a possibly dead worker; the others go elsewhere meanwhile). No side effects: pools ask freely."""
        if self.breaker.current_state != pybreaker.STATE_OPEN:
            return True
        now = time.time()
        opened_at = self.breaker._state_storage.opened_at  # pybreaker keeps no public accessor for this
        if opened_at is not None and now - opened_at.timestamp() < self.breaker.reset_timeout:
            return False
        probe = self._probe_started
        return probe is None or now - probe >= self.breaker.reset_timeout  # a probe that never reported is stale

    def begin_call(self) -> None:
        """Called just before an RPC to this endpoint: if the breaker is open, this call is the half-open probe."""
        if self.breaker.current_state == pybreaker.STATE_OPEN:
            self._probe_started = time.time()

    def record_success(self) -> None:
        self._probe_started = None
        try:
            self.breaker.call(lambda: None)
        except pybreaker.CircuitBreakerError:
            pass  # still open (a concurrent failure re-opened it): nothing to record

    def record_failure(self) -> None:
        self._probe_started = None

        def fail() -> None:
            raise _Recorded()

        try:
            self.breaker.call(fail)
        except (_Recorded, pybreaker.CircuitBreakerError):
            pass
