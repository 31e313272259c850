"""Pools of drafter or verifier endpoints: health watching, circuit breakers, spreading sessions.

`--verifier` may be repeated, and a `dns:///name:port` target expands to every address the name resolves to (a
Kubernetes headless Service), re-resolved when no endpoint is usable. A new session goes to the least loaded endpoint,
or to the one that most likely holds its prompt's prefix in its prefix cache (prefix affinity), within a slack.

Where something else knows the live workers (Ray Serve's replicas: specmesh/rayserve/ingress.py), it hands the pool
the whole set with `set_addresses`: new addresses become endpoints, and an address that left is retired: no new
session goes there, its sessions move on at their next call (the next verifier rebuilds the KV cache from the
history), and its endpoint is closed once none is pinned to it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from functools import partial

import grpc
from grpc_health.v1 import health_pb2

from coordinator.fleet.connect_errors import diagnose
from coordinator.fleet.polling import wait_until
from coordinator.fleet.resilience import EndpointBreaker, NoWorkerAvailable, ResilienceConfig, TransitionLog
from coordinator.fleet.worker_client import RemoteWorker, WorkerError
from specmesh.wire.security import ClientSecurity

log = logging.getLogger("specmesh.fleet")

_SERVING = health_pb2.HealthCheckResponse.SERVING
MISCONFIGURED_AFTER_S = 2.0  # how long every endpoint must fail to connect before start-up gives up on a cause
RECENT_HISTORIES = 64  # finished sessions remembered per endpoint for prefix affinity
AFFINITY_MIN_TOKENS = 32  # a shorter shared prefix (a chat template's header) is not worth an unbalanced placement
AFFINITY_SLACK = 1  # pinned sessions the endpoint holding the prefix may have over the least loaded one


def expand_targets(targets: Sequence[str]) -> list[str]:
    """host:port stays as given (gRPC resolves it); dns:///name:port becomes one address per resolved IP."""
    addresses: list[str] = []
    for target in targets:
        if target.startswith("dns:///"):
            host, _, port = target[len("dns:///"):].rpartition(":")
            try:
                infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
            except (socket.gaierror, ValueError) as e:
                log.warning("cannot resolve %s: %s", target, e)
                continue
            for family, _, _, _, sockaddr in infos:
                ip = sockaddr[0]
                address = f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"
                if address not in addresses:
                    addresses.append(address)
        elif target not in addresses:
            addresses.append(target)
    return addresses


class Endpoint:
    """One worker of a pool: its client (channel and stubs), a breaker, and its health as reported by a
    grpc.health.v1 Watch stream."""

    def __init__(self, client: RemoteWorker, breaker: EndpointBreaker, health_log: Counter) -> None:
        self.client = client
        self.address, self.role = client.address, client.role
        self.breaker = breaker
        self.serving = False
        self.retired = False  # left the pool's address set (set_addresses): used by no session once they move on
        self.sessions = 0  # generations currently pinned here
        # The token histories of the last sessions that ended here: what the worker's prefix cache most likely holds
        # (a coordinator-side shadow, as SGLang's cache-aware router keeps; the worker is never asked).
        self.recent_histories: deque[tuple[int, ...]] = deque(maxlen=RECENT_HISTORIES)
        self.last_error = ""  # the details of the health stream's last failure; "" once it delivers a status
        self.failing_since: float | None = None  # monotonic time since when every health stream has failed
        self._health_log = health_log
        self._closed = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name=f"health-{self.address}", daemon=True)
        self._watcher.start()

    def cached_prefix_length(self, tokens: Sequence[int]) -> int:
        """The longest prefix of `tokens` that a session which ended here has held."""
        tokens = tuple(tokens)
        return max((len(os.path.commonprefix([history, tokens])) for history in self.recent_histories), default=0)

    @property
    def stub(self):
        return self.client.stub

    def info(self, timeout_s: float = 10.0):
        return self.client.info(timeout_s)

    def end_session(self, session_id: str) -> None:
        self.client.end_session(session_id)

    def usable(self) -> bool:
        return self.serving and not self.retired and self.breaker.allows_call()

    def _set_serving(self, serving: bool) -> None:
        if serving != self.serving:
            self._health_log[(self.address, "SERVING" if serving else "NOT_SERVING")] += 1
            log.info("%s %s is %s", self.role, self.address, "SERVING" if serving else "NOT SERVING")
        self.serving = serving

    def _watch(self) -> None:
        backoff = 0.1
        while not self._closed.is_set():
            try:
                for reply in self.client.health.Watch(health_pb2.HealthCheckRequest(service="")):
                    self.last_error, self.failing_since = "", None  # reachable (perhaps still loading)
                    self._set_serving(reply.status == _SERVING)
                    backoff = 0.1
            except grpc.RpcError as e:
                # The worker is gone or restarting, or cannot be reached at all: not serving until a new stream says
                # otherwise. What failed is kept for the start-up diagnosis (WorkerPool.wait_any_serving).
                self.last_error = f"{e.code().name}: {e.details()}"
                if self.failing_since is None:
                    self.failing_since = time.monotonic()
            self._set_serving(False)
            self._closed.wait(backoff)
            backoff = min(backoff * 2, 0.5)  # a restarted worker is seen within half a second

    def close(self) -> None:
        self._closed.set()
        self.client.close()  # also ends the Watch stream the watcher thread is reading


Connect = Callable[[str, str], RemoteWorker]  # (address, role) -> a client for that worker


class WorkerPool:
    """The endpoints of one role; `pick` chooses where a session goes."""

    def __init__(self, targets: Sequence[str], role: str, config: ResilienceConfig,
                 transitions: TransitionLog | None = None, security: ClientSecurity = ClientSecurity(),
                 connect: Connect | None = None) -> None:
        """`connect` makes each endpoint's client (default: a RemoteWorker with `security`; tests pass fakes)."""
        self.role, self.config, self.targets = role, config, list(targets)
        self.security = security
        self._diagnoses: dict[tuple[str, str], object] = {}  # (address, error) -> ConnectFailure | None
        self.connect = connect if connect is not None else partial(RemoteWorker, security=security,
                                                                   options=config.channel_options())
        self.transitions = transitions or TransitionLog()
        self.health_log: Counter = Counter()  # (address, "SERVING"/"NOT_SERVING") -> times seen
        self._lock = threading.Lock()
        self.endpoints: list[Endpoint] = []
        self._last_resolve = 0.0
        self._refresh()
        if not self.endpoints:
            raise ValueError(f"no {role} address in {list(targets)}")

    def _refresh(self) -> None:
        """Add endpoints for addresses the targets now resolve to (new pods of a headless Service)."""
        self._last_resolve = time.monotonic()
        known = {e.address for e in self.endpoints}
        for address in expand_targets(self.targets):
            if address not in known:
                breaker = EndpointBreaker(f"{self.role}@{address}", self.config, self.transitions)
                self.endpoints.append(Endpoint(self.connect(address, self.role), breaker, self.health_log))

    def set_addresses(self, addresses: Sequence[str]) -> tuple[list[str], list[str]]:
        """Make `addresses` the pool's workers (from whoever knows the live ones); (added, retired) addresses.

        The endpoint list is replaced, never changed in place, so that a reader iterating it sees one whole list. A
        retired endpoint stays in the list, unusable, until no session is pinned to it (a session's next call moves
        it: see Endpoint.usable); then it is closed. An address that comes back before that is taken back."""
        wanted = list(dict.fromkeys(addresses))
        added, retired = [], []
        with self._lock:
            self.targets = wanted
            by_address = {e.address: e for e in self.endpoints}
            endpoints = []
            for endpoint in self.endpoints:
                if endpoint.address in wanted:
                    endpoint.retired = False
                    endpoints.append(endpoint)
                    continue
                if not endpoint.retired:
                    endpoint.retired = True
                    retired.append(endpoint.address)
                    log.info("%s %s left the pool; its sessions move on", self.role, endpoint.address)
                if endpoint.sessions > 0:
                    endpoints.append(endpoint)
                else:
                    endpoint.close()
            for address in wanted:
                if address not in by_address:
                    breaker = EndpointBreaker(f"{self.role}@{address}", self.config, self.transitions)
                    endpoints.append(Endpoint(self.connect(address, self.role), breaker, self.health_log))
                    added.append(address)
                    log.info("%s %s joined the pool", self.role, address)
            self.endpoints = endpoints
        return added, retired

    def first_serving(self) -> Endpoint | None:
        return next((e for e in self.endpoints if e.serving and not e.retired), None)

    def wait_any_serving(self, timeout_s: float, unreachable_timeout_s: float | None = None) -> Endpoint | None:
        """The first endpoint health reports SERVING, waiting up to `timeout_s` for one; None if none is.

        Fails fast (WorkerError naming the cause) when no endpoint can even be connected to: after
        MISCONFIGURED_AFTER_S for TLS settings that do not match the worker's, after `unreachable_timeout_s` for
        refused connections and unknown names (None: wait the whole `timeout_s` for those). A worker that answers
        but is still loading is waited for."""
        def give_up_if_unreachable() -> None:
            failing = [e for e in self.endpoints if e.failing_since is not None and e.last_error]
            if not self.endpoints or len(failing) < len(self.endpoints):
                return  # some endpoint is reachable (or has not been tried yet): keep waiting
            now = time.monotonic()
            if now - max(e.failing_since for e in failing) < MISCONFIGURED_AFTER_S:
                return  # a moment of failure proves nothing (a worker restarting)
            failures = [self._diagnose(e) for e in failing]
            if any(f is None for f in failures):
                return  # a cause we cannot name (a timeout): the full timeout applies
            longest = now - min(e.failing_since for e in failing)
            if all(f.misconfigured for f in failures) or (
                    unreachable_timeout_s is not None and longest >= unreachable_timeout_s):
                raise WorkerError("; ".join(f"{self.role} at {e.address}: {f.cause}"
                                            for e, f in zip(failing, failures)))

        wait_until(self.first_serving, timeout_s, on_wait=give_up_if_unreachable)
        return self.first_serving()

    def _diagnose(self, endpoint: Endpoint):
        """The endpoint's connect failure, worked out once per distinct error (it may open a TLS connection)."""
        key = (endpoint.address, endpoint.last_error)
        if key not in self._diagnoses:
            self._diagnoses[key] = diagnose(endpoint.address, endpoint.last_error, self.security)
        return self._diagnoses[key]

    def connect_errors(self) -> str:
        """What the endpoints' health streams last failed with ("" when none failed), for a timeout's message."""
        return "; ".join(f"{e.address}: {e.last_error}" for e in self.endpoints if e.last_error)

    def pick(self, avoid: Endpoint | None = None, tokens: Sequence[int] = ()) -> Endpoint:
        """A usable endpoint with the fewest pinned sessions, other than `avoid` when there is a choice; or, for a
        session starting with `tokens`, the one whose prefix cache likely holds the longest prefix of them (at least
        AFFINITY_MIN_TOKENS), unless it has more than AFFINITY_SLACK sessions over the least loaded."""
        with self._lock:
            usable = [e for e in self.endpoints if e.usable()]
            if not usable and any("dns:///" in t for t in self.targets) and time.monotonic() - self._last_resolve > 2:
                self._refresh()
                usable = [e for e in self.endpoints if e.usable()]
            others = [e for e in usable if e is not avoid]
            candidates = others or usable
            if not candidates:
                raise NoWorkerAvailable(f"no {self.role} is serving with a closed breaker "
                                        f"({', '.join(e.address for e in self.endpoints)})")
            # Closed breakers before probing ones (a half-open endpoint may still be dead), then fewest pinned
            # sessions; ties go to the earliest listed endpoint, so placement is predictable.
            least = min(candidates, key=lambda e: (e.breaker.state != "closed", e.sessions))
            if tokens and least.breaker.state == "closed":
                # Turn n of a conversation where turn n-1 ran: that worker prefills only what turn n added.
                cached = {id(e): e.cached_prefix_length(tokens) for e in candidates if e.breaker.state == "closed"}
                best = max((e for e in candidates if id(e) in cached), key=lambda e: cached[id(e)])
                if cached[id(best)] >= AFFINITY_MIN_TOKENS and best.sessions <= least.sessions + AFFINITY_SLACK:
                    return best
            return least

    def close(self) -> None:
        for endpoint in self.endpoints:
            endpoint.close()
