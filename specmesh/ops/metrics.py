"""Prometheus metrics (prometheus-client), served by every process with --metrics-port.

Definitions follow vLLM's: acceptance rate = accepted draft tokens / drafted tokens; mean acceptance length =
1 + accepted draft tokens / drafts (rounds that carried drafts), i.e. tokens committed per speculative round.
"""

from __future__ import annotations

import threading

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# --- workers ---
RPC_REQUESTS = Counter("specmesh_rpc_requests", "RPCs handled, by service, method and status code",
                       ["service", "method", "code"])
RPC_LATENCY = Histogram("specmesh_rpc_latency_seconds", "RPC handling time", ["service", "method"],
                        buckets=LATENCY_BUCKETS)
VERIFY_BATCH_SIZE = Histogram("specmesh_verify_batch_size", "sessions verified together in one target forward pass",
                              buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32))
DRAFT_BATCH_SIZE = Histogram("specmesh_draft_batch_size", "sessions drafting together in one draft-model forward pass "
                             "(one draft step)", buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32))
DRAFT_TOKENS_PROPOSED = Counter("specmesh_drafter_proposed_tokens", "draft tokens proposed by this drafter")

# --- coordinator ---
GENERATIONS = Counter("specmesh_generations", "generations finished, by finish reason", ["finish_reason"])
GENERATION_LATENCY = Histogram("specmesh_generation_latency_seconds", "wall time of a generation",
                               buckets=LATENCY_BUCKETS)
TOKENS_GENERATED = Counter("specmesh_generated_tokens", "tokens committed to generations")
DRAFTED_TOKENS = Counter("specmesh_drafted_tokens", "draft tokens sent to verification")
ACCEPTED_TOKENS = Counter("specmesh_accepted_tokens", "draft tokens the target accepted")
DRAFTS = Counter("specmesh_drafts", "speculative rounds that carried drafts")
ROUNDS = Counter("specmesh_rounds", "verification rounds (with or without drafts)")
POSITION_DRAFTED = Counter("specmesh_drafted_tokens_per_position", "draft tokens at each draft position",
                           ["position"])
POSITION_ACCEPTED = Counter("specmesh_accepted_tokens_per_position", "accepted draft tokens at each position",
                            ["position"])
RETRIES = Counter("specmesh_retries", "RPC attempts repeated after a retryable error")
FAILOVERS = Counter("specmesh_failovers", "sessions moved to another verifier")
DEGRADED_ROUNDS = Counter("specmesh_degraded_rounds", "rounds decoded without drafts because no drafter answered")
RESYNCS = Counter("specmesh_resyncs", "calls repeated with the full history")
BREAKER_TRANSITIONS = Counter("specmesh_breaker_transitions", "circuit breaker state changes",
                              ["endpoint", "from_state", "to_state"])
ACCEPTANCE_RATE = Gauge("specmesh_acceptance_rate", "accepted / drafted tokens since start")
ACCEPTANCE_RATE.set_function(lambda: ACCEPTED_TOKENS._value.get() / max(DRAFTED_TOKENS._value.get(), 1))
MEAN_ACCEPTANCE_LENGTH = Gauge("specmesh_mean_acceptance_length", "1 + accepted tokens / drafts since start")
MEAN_ACCEPTANCE_LENGTH.set_function(lambda: 1 + ACCEPTED_TOKENS._value.get() / max(DRAFTS._value.get(), 1))


def record_generation(result, elapsed_s: float) -> None:
    """Count one finished (or failed) generation of the coordinator."""
    GENERATIONS.labels(result.finish_reason).inc()
    GENERATION_LATENCY.observe(elapsed_s)
    TOKENS_GENERATED.inc(len(result.token_ids))
    for r in result.rounds:
        ROUNDS.inc()
        if r.drafted:
            DRAFTS.inc()
            DRAFTED_TOKENS.inc(r.drafted)
            ACCEPTED_TOKENS.inc(r.accepted)
            for position in range(r.drafted):
                POSITION_DRAFTED.labels(str(position)).inc()
                if position < r.accepted:
                    POSITION_ACCEPTED.labels(str(position)).inc()
    stats = result.stats
    RETRIES.inc(stats.get("retries", 0))
    FAILOVERS.inc(stats.get("failovers", 0))
    DEGRADED_ROUNDS.inc(stats.get("degraded_rounds", 0))
    RESYNCS.inc(stats.get("resyncs", 0))


class StateCollector:
    """Scrape-time gauges from live objects (sessions and KV bytes of a worker; breakers and health of a pool)."""

    def __init__(self, collect) -> None:
        self._collect = collect

    def collect(self):
        yield from self._collect()

    def describe(self):
        return []  # no up-front description: several workers may live in one (test) process


_registered: dict[str, StateCollector] = {}
_lock = threading.Lock()


def register_state(name: str, collect) -> None:
    """(Re)register a scrape-time collector under `name`, replacing an earlier one of the same name."""
    with _lock:
        if name in _registered:
            REGISTRY.unregister(_registered.pop(name))
        collector = StateCollector(collect)
        REGISTRY.register(collector)
        _registered[name] = collector


def unregister_state(name: str) -> None:
    with _lock:
        if name in _registered:
            REGISTRY.unregister(_registered.pop(name))


def gauge(name: str, documentation: str, labels: list[str], samples) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=labels)
    for label_values, value in samples:
        family.add_metric(label_values, value)
    return family


def serve_metrics(port: int | None, host: str = "127.0.0.1") -> int | None:
    """Expose /metrics on `port` (0 = a free one); returns the port, or None when port is None."""
    if port is None:
        return None
    server, _ = start_http_server(port, addr=host)
    return server.server_address[1]


def read_histogram(url: str, name: str, timeout_s: float = 10.0) -> tuple[float, float]:
    """(sum, count) of histogram `name` as served at `url` (a /metrics endpoint), e.g. a worker's batch sizes."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=timeout_s).read().decode()
    values = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    return values.get(f"{name}_sum", 0.0), values.get(f"{name}_count", 0.0)
