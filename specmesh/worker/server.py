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
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specmesh.ops import logs
from specmesh.ops import metrics
from specmesh.runtime import onednn
from specmesh.wire.limits import DEFAULT_MAX_DRAFT_TOKENS
from specmesh.runtime.devices import dtype_name
from specmesh.wire.history import ResyncRequired
from specmesh.runtime.models import LoadedModel
from specmesh.runtime.engine import ENGINES, as_engine, load_engine
from specmesh.wire.security import ConcurrencyLimitInterceptor, TlsFiles, TokenAuthInterceptor, caller_identity
from specmesh.wire.contract import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS, RESYNC_PREFIX, Cancelled, NotReady
from specmesh.worker.session_store import SessionLimits
from specmesh.v1 import specmesh_pb2 as pb
from specmesh.wire.validation import check_session_id

log = logging.getLogger(__name__)

SERVER_OPTIONS = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.so_reuseport", 0),  # an ephemeral port must never be shared with a stale server
]


@dataclass(frozen=True)
class WorkerConfig:
    model: str
    role: str  # "drafter" or "verifier"
    host: str = "127.0.0.1"
    port: int = 0
    device: str = "auto"
    dtype: str = "auto"
    linear_backend: str = "auto"  # CPU: "onednn" pre-packs linear layers (specmesh/runtime/onednn.py), "torch" does not
    engine: str = "auto"  # "transformers", "llamacpp", or auto: llama.cpp for GGUF models on CPU (specmesh/runtime)
    threads: int | None = None
    limits: SessionLimits = field(default_factory=SessionLimits)
    max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS
    max_context_length: int | None = None  # None: the model's max_position_embeddings
    inject_latency_s: float = 0.0  # testing knob: every Propose/Verify first waits this long (a slow worker)
    tls: TlsFiles | None = None  # server certificate (+ CA: require client certificates, mutual TLS)
    token: str | None = None  # bearer token every non-health RPC must carry
    max_message_bytes: int = 4 * 1024 * 1024
    max_concurrent_rpcs: int = 64  # beyond this, calls are answered RESOURCE_EXHAUSTED
    max_batch_size: int = 8  # verifier: concurrent sessions' Verify calls run as one forward pass of up to this many
    max_batch_wait_s: float = 0.02  # verifier: how long a pass may wait for active sessions' next calls to join it

    def __post_init__(self) -> None:
        if self.role not in ("drafter", "verifier"):
            raise ValueError(f"role must be 'drafter' or 'verifier', got {self.role!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.max_draft_tokens < 1:
            raise ValueError(f"max_draft_tokens must be >= 1, got {self.max_draft_tokens}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if self.linear_backend not in onednn.BACKENDS:
            raise ValueError(f"linear_backend must be one of {', '.join(onednn.BACKENDS)}, "
                             f"got {self.linear_backend!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if not 0 <= self.max_batch_wait_s <= 10:
            raise ValueError(f"max_batch_wait_s must be in 0..10 seconds, got {self.max_batch_wait_s}")
        if self.max_concurrent_rpcs < 1:
            raise ValueError(f"max_concurrent_rpcs must be >= 1, got {self.max_concurrent_rpcs}")
        if self.token is not None and len(self.token) < 16:
            raise ValueError("the bearer token must be at least 16 characters")
        if not self.inject_latency_s >= 0:
            raise ValueError(f"inject_latency_s must be >= 0, got {self.inject_latency_s}")
        if self.max_context_length is not None and self.max_context_length < 2:
            raise ValueError(f"max_context_length must be >= 2, got {self.max_context_length}")


def resident_bytes() -> int:
    """This process's resident set size (Linux; 0 elsewhere). Prometheus exports the same as
    process_resident_memory_bytes."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def rpc(handler: Callable) -> Callable:
    """Map exceptions of a servicer method to gRPC status codes; the server keeps serving after any of them."""

    @functools.wraps(handler)
    def wrapper(self, request, context: grpc.ServicerContext):
        started, code = time.perf_counter(), "OK"
        logs.session_id.set(getattr(request, "session_id", ""))
        logs.request_id.set(dict(context.invocation_metadata() or ()).get("x-request-id", ""))
        try:
            return handler(self, request, context)
        except Exception as e:
            code = ("UNAVAILABLE" if isinstance(e, NotReady) else "CANCELLED" if isinstance(e, Cancelled) else
                    "FAILED_PRECONDITION" if isinstance(e, ResyncRequired) else
                    "INVALID_ARGUMENT" if isinstance(e, ValueError) else "UNKNOWN")
            _abort(context, e)
        finally:
            service = self.worker.config.role
            metrics.RPC_REQUESTS.labels(service, handler.__name__, code).inc()
            metrics.RPC_LATENCY.labels(service, handler.__name__).observe(time.perf_counter() - started)
            log.debug("%s %s in %.1f ms", handler.__name__, code, 1000 * (time.perf_counter() - started))

    return wrapper


def _abort(context: grpc.ServicerContext, error: Exception) -> None:
    """Answer with the status code that matches `error`; anything unexpected propagates (gRPC answers UNKNOWN)."""
    if isinstance(error, NotReady):
        context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
    if isinstance(error, Cancelled):
        context.abort(grpc.StatusCode.CANCELLED, str(error))
    if isinstance(error, ResyncRequired):
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{RESYNC_PREFIX} {error}")
    if isinstance(error, ValueError):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
    raise error


class WorkerServicerBase:
    """Info and EndSession, identical on both services; `engine` is set once the model is ready."""

    def __init__(self, worker: "WorkerServer") -> None:
        self.worker = worker

    @property
    def engine(self):
        engine = self.worker.engine
        if engine is None:
            raise NotReady(f"{self.worker.config.role} is still loading its model")
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
        delay = self.worker.config.inject_latency_s
        if delay:
            self.worker.stopping.wait(delay)
        if not context.is_active():
            raise Cancelled("the call was cancelled or its deadline passed before work started")

    @rpc
    def Info(self, request, context) -> pb.InfoResponse:
        loaded: LoadedModel = self.engine.loaded
        return pb.InfoResponse(
            model_name=loaded.name, vocab_size=loaded.vocab_size, tokenizer_fingerprint=loaded.fingerprint,
            eos_token_ids=list(loaded.eos_token_ids), device=str(loaded.device), dtype=dtype_name(loaded.dtype),
            max_draft_tokens=self.worker.config.max_draft_tokens, max_context_length=self.worker.max_context_length,
            role=self.worker.config.role, active_sessions=len(self.engine.sessions),
            engine=getattr(loaded, "engine", ""), resident_bytes=resident_bytes(),
            weights_bytes=getattr(loaded, "weights_bytes", 0),
            draft_per_token_s=getattr(self.engine, "draft_per_token_s", 0.0),
            verify_base_s=getattr(self.engine, "verify_base_s", 0.0),
            verify_per_draft_s=getattr(self.engine, "verify_per_draft_s", 0.0))

    @rpc
    def EndSession(self, request, context) -> pb.EndSessionResponse:
        engine = self.engine
        end = getattr(engine, "end_session", engine.sessions.end)  # the verifier also forgets the session's pace
        return pb.EndSessionResponse(existed=end(self.session_key(request.session_id, context)))


class WorkerServer:
    """One gRPC server owning one model. `engine_factory(loaded, limits)` builds the role's engine."""

    def __init__(self, config: WorkerConfig, engine_factory: Callable, servicer_factory: Callable,
                 add_servicer: Callable, service_name: str, preloaded: LoadedModel | None = None) -> None:
        self.config = config
        self.engine = None
        self.max_context_length = 0
        self._engine_factory = engine_factory
        self._preloaded = preloaded
        self._service_name = service_name
        options = [*SERVER_OPTIONS, ("grpc.max_receive_message_length", config.max_message_bytes),
                   ("grpc.max_send_message_length", config.max_message_bytes)]
        # Enough threads that calls beyond the limit reach the interceptor and are refused, rather than queue.
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=config.max_concurrent_rpcs + 8,
                                                              thread_name_prefix=config.role),
                                   options=options,
                                   # Authentication first: an unauthenticated caller never takes a slot.
                                   interceptors=[*([TokenAuthInterceptor(config.token)] if config.token else []),
                                                 ConcurrencyLimitInterceptor(config.max_concurrent_rpcs)])
        self.health = health.HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        add_servicer(servicer_factory(self), self._server)
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        bind = f"[{config.host}]:{config.port}" if ":" in config.host else f"{config.host}:{config.port}"
        if config.tls is not None and config.tls.enabled:
            self.port = self._server.add_secure_port(bind, config.tls.server_credentials())
        else:
            self.port = self._server.add_insecure_port(bind)
        if self.port == 0:
            raise OSError(f"could not bind {config.host}:{config.port}")
        self._stopped = threading.Event()
        self.stopping = self._stopped  # set once shutdown begins: injected waits end early
        self.terminated = threading.Event()  # set once every call has finished or been cancelled

    @property
    def address(self) -> str:
        host = self.config.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def _set_health(self, status) -> None:
        for name in ("", self._service_name):
            self.health.set(name, status)

    def start(self) -> None:
        self._server.start()

    def obtain_model(self):
        """What the role's engine runs on: a model engine (specmesh/runtime); subclasses may build something
        lighter."""
        if self._preloaded is not None:
            return as_engine(self._preloaded)
        config = self.config
        return load_engine(config.model, engine=config.engine, device=config.device, dtype=config.dtype,
                           linear_backend=config.linear_backend, threads=config.threads,
                           max_sessions=config.limits.max_sessions, context_length=config.max_context_length)

    @staticmethod
    def context_limit(loaded) -> int | None:
        return loaded.context_limit

    def load(self) -> None:
        """Load the model, run a warm-up pass, then report SERVING."""
        loaded = self.obtain_model()
        model_limit = self.context_limit(loaded) or 2**31 - 1
        self.max_context_length = min(self.config.max_context_length or model_limit, model_limit)
        engine = self._engine_factory(loaded, self)
        engine.warm_up()
        self.engine = engine
        role = self.config.role
        metrics.register_state(f"{role}:{self.port}", lambda: [
            metrics.gauge("specmesh_active_sessions", "sessions whose KV cache this worker holds", ["role"],
                          [([role], len(engine.sessions))]),
            metrics.gauge("specmesh_kv_cache_bytes", "bytes of keys/values cached across sessions", ["role"],
                          [([role], engine.sessions.cache_bytes)])])
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("%s ready: model=%s engine=%s device=%s dtype=%s linear=%s port=%d", self.config.role, loaded.name,
                 getattr(loaded, "engine", "-"), loaded.device, dtype_name(loaded.dtype),
                 getattr(loaded, "linear_backend", "-"), self.port)

    def stop(self, grace: float | None = 2.0) -> None:
        """Report NOT_SERVING, refuse new calls, let in-flight calls finish within `grace` seconds."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        metrics.unregister_state(f"{self.config.role}:{self.port}")
        self.health.enter_graceful_shutdown()
        self._server.stop(grace).wait()
        self.terminated.set()

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
