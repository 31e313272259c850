"""gRPC plumbing shared by the drafter and verifier services: server lifecycle, health, Info/EndSession, error mapping.

A server binds its port first and reports NOT_SERVING on grpc.health.v1 while the model loads; it switches to SERVING
only after the model has loaded and run a warm-up pass, so load balancers and the coordinator never route to a cold
worker.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specmesh.ops import logs
from specmesh.ops import metrics
from specmesh.runtime.memory import return_freed_memory
from specmesh.v1 import specmesh_pb2 as pb
from specmesh.wire.contract import (KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS, MIN_PING_INTERVAL_MS, RESYNC_PREFIX,
                                    Cancelled, NotReady)
from specmesh.wire.history import ResyncRequired
from specmesh.wire.security import ConcurrencyLimitInterceptor, TokenAuthInterceptor, caller_identity
from specmesh.wire.validation import check_session_id
from specmesh.worker.config import FaultInjection, ServerConfig
from specmesh.worker.malformed_requests import MalformedRequestInterceptor
from specmesh.worker.role import WorkerEngine, WorkerRole

log = logging.getLogger(__name__)

STOP_MARGIN_S = 5.0  # how long stop() waits for gRPC beyond the grace period before giving up on it
QUIET_BEFORE_CANCEL_S = 0.2  # no servicer call in flight for this long while stopping: cancel the rest (Watch streams)

SERVER_OPTIONS = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.so_reuseport", 0),  # an ephemeral port must never be shared with a stale server
]


def prefix_cache_fields(engine) -> dict[str, int]:
    """The model engine's prefix-cache counters, by InfoResponse field name (none for engines without one)."""
    loaded = getattr(engine, "loaded", None)
    return {"prefix_cache_hits": getattr(loaded, "prefix_hits", 0),
            "prefix_cache_reused_tokens": getattr(loaded, "prefix_reused_tokens", 0)}


def resident_bytes() -> int:
    """This process's resident set size (Linux; 0 elsewhere). Prometheus exports the same as
    process_resident_memory_bytes."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


# What a servicer's exception is answered with, first match wins; the code also labels the rpc metrics. Anything else
# propagates (gRPC answers UNKNOWN).
ERROR_STATUS: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (NotReady, grpc.StatusCode.UNAVAILABLE),
    (Cancelled, grpc.StatusCode.CANCELLED),
    (ResyncRequired, grpc.StatusCode.FAILED_PRECONDITION),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)


def status_for(error: Exception) -> grpc.StatusCode:
    return next((code for kind, code in ERROR_STATUS if isinstance(error, kind)), grpc.StatusCode.UNKNOWN)


@contextmanager
def _served(servicer, name: str, request, context: grpc.ServicerContext) -> Iterator[None]:
    """One servicer call: logging context, in-flight count, exceptions mapped to status codes, metrics."""
    started, code = time.perf_counter(), "OK"
    logs.session_id.set(getattr(request, "session_id", ""))
    logs.request_id.set(dict(context.invocation_metadata() or ()).get("x-request-id", ""))
    try:
        with servicer.worker.call_in_flight():
            yield
    except Exception as e:
        status = status_for(e)
        code = status.name
        if status == grpc.StatusCode.UNKNOWN:
            raise
        # The resync prefix is what clients recognise (coordinator/fleet/channel.py).
        context.abort(status, f"{RESYNC_PREFIX} {e}" if isinstance(e, ResyncRequired) else str(e))
    finally:
        service = servicer.worker.role.name
        metrics.RPC_REQUESTS.labels(service, name, code).inc()
        metrics.RPC_LATENCY.labels(service, name).observe(time.perf_counter() - started)
        log.debug("%s %s in %.1f ms", name, code, 1000 * (time.perf_counter() - started))


def rpc(handler: Callable) -> Callable:
    """Map exceptions of a servicer method to gRPC status codes; the server keeps serving after any of them."""

    @functools.wraps(handler)
    def wrapper(self, request, context: grpc.ServicerContext):
        with _served(self, handler.__name__, request, context):
            return handler(self, request, context)

    return wrapper


def rpc_stream(handler: Callable) -> Callable:
    """`rpc` for a method that streams its responses (a generator): an exception raised between two responses ends
    the stream with its status code."""

    @functools.wraps(handler)
    def wrapper(self, request, context: grpc.ServicerContext):
        with _served(self, handler.__name__, request, context):
            yield from handler(self, request, context)

    return wrapper


class WorkerServicerBase:
    """Info and EndSession, identical on both services; `engine` is the role's engine once it is ready."""

    def __init__(self, worker: "WorkerServer") -> None:
        self.worker = worker

    @property
    def engine(self) -> WorkerEngine:
        engine = self.worker.engine
        if engine is None:
            raise NotReady(f"{self.worker.role.name} is still loading its model")
        return engine

    @staticmethod
    def session_key(session_id: str, context: grpc.ServicerContext) -> str:
        """Sessions are namespaced by the authenticated caller: one client cannot name another's session."""
        check_session_id(session_id)
        identity = caller_identity.get()
        if not identity:
            subject = (context.auth_context() or {}).get("x509_subject")
            identity = "cert:" + subject[0].decode(errors="replace") if subject else ""
        return f"{identity}/{session_id}"

    def before_work(self, context: grpc.ServicerContext) -> None:
        """Injected latency (tests), then give up early if the caller has already gone."""
        delay = self.worker.faults.next_delay()
        if delay:
            self.worker.stopping.wait(delay)
        if not context.is_active():
            raise Cancelled("the call was cancelled or its deadline passed before work started")

    @rpc
    def Info(self, request, context) -> pb.InfoResponse:
        engine, worker = self.engine, self.worker
        model = engine.description
        return pb.InfoResponse(
            model_name=model.name, vocab_size=model.vocab_size, tokenizer_fingerprint=model.fingerprint,
            eos_token_ids=list(model.eos_token_ids), device=model.device, dtype=model.dtype,
            max_draft_tokens=worker.config.max_draft_tokens, max_context_length=worker.max_context_length,
            role=worker.role.name, active_sessions=len(engine.sessions), engine=model.engine,
            resident_bytes=resident_bytes(), weights_bytes=model.weights_bytes, **prefix_cache_fields(engine),
            deterministic=model.deterministic, engine_build=model.build,
            **worker.role.info_fields(engine))

    @rpc
    def EndSession(self, request, context) -> pb.EndSessionResponse:
        return pb.EndSessionResponse(existed=self.engine.end_session(self.session_key(request.session_id, context)))


class WorkerServer:
    """One gRPC server serving one role: the role registers its servicer and, in load(), builds its engine."""

    def __init__(self, role: WorkerRole, config: ServerConfig = ServerConfig(),
                 faults: FaultInjection = FaultInjection()) -> None:
        self.role = role
        self.config = config
        self.faults = faults
        self.engine: WorkerEngine | None = None
        self.max_context_length = 0
        options = [*SERVER_OPTIONS, ("grpc.max_receive_message_length", config.max_message_bytes),
                   ("grpc.max_send_message_length", config.max_message_bytes)]
        # Enough threads that calls beyond the limit reach the interceptor and are refused, rather than queue.
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=config.max_concurrent_rpcs + 8,
                                                              thread_name_prefix=role.name),
                                   options=options,
                                   # Authentication first: an unauthenticated caller never takes a slot; nor
                                   # does a request that is not a valid message.
                                   interceptors=[*([TokenAuthInterceptor(config.token)] if config.token else []),
                                                 MalformedRequestInterceptor(),
                                                 ConcurrencyLimitInterceptor(config.max_concurrent_rpcs)])
        self.health = health.HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        role.add_servicer(self, self._server)
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        bind = f"[{config.host}]:{config.port}" if ":" in config.host else f"{config.host}:{config.port}"
        if config.tls is not None and config.tls.enabled:
            self.port = self._server.add_secure_port(bind, config.tls.server_credentials())
        else:
            self.port = self._server.add_insecure_port(bind)
        if self.port == 0:
            raise OSError(f"could not bind {config.host}:{config.port}")
        self._stop_lock = threading.Lock()
        self._stopped = threading.Event()
        self.stopping = self._stopped  # set once shutdown begins: injected waits end early
        self.stop_started = 0.0  # time.monotonic() when it began
        self.terminated = threading.Event()  # set once stop() has ended, however it ended
        self._calls_lock = threading.Lock()
        self._calls = 0
        self.drained = threading.Event()  # set while no servicer call is running (checked by the model loop at exit)
        self.drained.set()

    @property
    def address(self) -> str:
        host = self.config.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def _set_health(self, status) -> None:
        for name in ("", self.role.service_name):
            self.health.set(name, status)

    def start(self) -> None:
        self._server.start()

    def load(self) -> None:
        """Build the role's engine (loading its model), run a warm-up pass, then report SERVING."""
        engine = self.role.build_engine(self.config)
        model = engine.description
        model_limit = model.context_limit or 2**31 - 1
        self.max_context_length = min(self.config.max_context_length or model_limit, model_limit)
        engine.warm_up()
        return_freed_memory()  # what loading and warming up freed (the tokenizer, the conversion's buffers)
        self.engine = engine
        role = self.role.name
        metrics.register_state(f"{role}:{self.port}", lambda: [
            metrics.gauge("specmesh_active_sessions", "sessions whose KV cache this worker holds", ["role"],
                          [([role], len(engine.sessions))]),
            metrics.gauge("specmesh_kv_cache_bytes", "bytes of keys/values cached across sessions", ["role"],
                          [([role], engine.sessions.cache_bytes)]),
            *[metrics.gauge(f"specmesh_{name}", what, ["role"], [([role], prefix_cache_fields(engine)[name])])
              for name, what in (("prefix_cache_hits", "sessions that started from a cached prefix"),
                                 ("prefix_cache_reused_tokens", "tokens reused from cached prefixes"))]])
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("%s ready: model=%s engine=%s%s device=%s dtype=%s linear=%s port=%d", role, model.name,
                 model.engine or "-", f" ({model.build})" if model.build else "", model.device, model.dtype,
                 model.linear_backend or "-", self.port)

    @contextmanager
    def call_in_flight(self) -> Iterator[None]:
        """Counts a servicer call while it runs (including its wait for the model thread)."""
        with self._calls_lock:
            self._calls += 1
            self.drained.clear()
        try:
            yield
        finally:
            with self._calls_lock:
                self._calls -= 1
                if self._calls == 0:
                    self.drained.set()

    @property
    def calls_in_flight(self) -> int:
        return self._calls

    def state(self) -> str:
        """What the server is doing, in words, for log lines about signals and stopping."""
        calls = f"{self._calls} call{'' if self._calls == 1 else 's'} in flight"
        if self.terminated.is_set():
            return f"stopped, {calls}"
        if self._stopped.is_set():
            return f"stopping for {time.monotonic() - self.stop_started:.1f} s, {calls}"
        return f"serving, {calls}" if self.engine is not None else "loading the model"

    def stop(self, grace: float | None = 2.0) -> None:
        """Report NOT_SERVING, refuse new calls, let in-flight calls finish within `grace` seconds, then cancel them.

        From any thread, any number of times: only the first call stops the server, later ones return at once.
        Whatever happens along the way (a step that raises, calls whose handlers do not return when cancelled),
        `terminated` is set when the first call returns, and it returns within `grace` + STOP_MARGIN_S seconds:
        whoever waits for it (the model loop on the main thread) is never left waiting on a stop that went wrong."""
        with self._stop_lock:
            if self._stopped.is_set():
                return
            self.stop_started = time.monotonic()
            self._stopped.set()
        log.info("%s stopping: %d call(s) in flight get %g s to finish", self.role.name, self._calls, grace or 0.0)
        try:
            for step in (lambda: metrics.unregister_state(f"{self.role.name}:{self.port}"),
                         self.health.enter_graceful_shutdown,
                         # A background cost probe (specmesh/worker/cost_probe.py) ends with the server.
                         lambda: getattr(self.engine, "stop_background_work", lambda: None)()):
                try:
                    step()
                except Exception:  # not worth a server that never stops
                    log.exception("%s: a step of stopping failed; stopping anyway", self.role.name)
            self._wait_for_grpc(grace or 0.0)
        finally:
            self.terminated.set()
            log.info("%s stopped in %.2f s", self.role.name, time.monotonic() - self.stop_started)

    def _wait_for_grpc(self, grace: float) -> None:
        """Stop gRPC: calls in flight get `grace` seconds, then are cancelled. Once no servicer call is left, the
        rest is cancelled at once: health Watch streams (a coordinator keeps one open to every worker) never end by
        themselves, and would hold every stop for the whole grace period. Bounded, whatever grpc does."""
        shutdown = self._server.stop(grace)
        limit = time.monotonic() + grace + STOP_MARGIN_S
        quiet_since, cancelled = None, False
        while not shutdown.wait(0.05):
            now = time.monotonic()
            if now > limit:
                log.error("%s: the gRPC server has not stopped %g s after stop began (%s); stopping anyway",
                          self.role.name, grace + STOP_MARGIN_S, self.state())
                return
            if cancelled or not self.drained.is_set():
                quiet_since = None
                continue
            quiet_since = quiet_since or now
            if now - quiet_since >= QUIET_BEFORE_CANCEL_S:  # a call accepted just before the stop has begun by now
                self._server.stop(0)  # grpc cancels what is left (with grace None it would also wait, unbounded)
                cancelled = True

    def wait(self) -> None:
        self._server.wait_for_termination()


@contextmanager
def serving(server: WorkerServer) -> Iterator[WorkerServer]:
    server.start()
    try:
        server.load()
        yield server
    finally:
        server.stop(grace=0.5)
