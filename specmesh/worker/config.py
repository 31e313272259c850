"""A worker's settings, one frozen dataclass per concern, each validated on construction.

ServerConfig is what every worker shares whatever its role (where it listens, who may call it, how much it accepts);
ModelConfig is which model a worker runs and how; FaultInjection holds the test-only knobs, kept out of both so that
a production configuration never carries them. Each role adds its own settings (drafter/config.py,
verifier/config.py).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specmesh.runtime import linear_backends
from specmesh.runtime.engine import ENGINES, ModelEngine, as_engine, load_engine
from specmesh.wire.limits import DEFAULT_MAX_DRAFT_TOKENS
from specmesh.wire.security import TlsFiles
from specmesh.worker.session_store import SessionLimits

if TYPE_CHECKING:  # for the annotation only: importing models imports torch, which a config need not
    from specmesh.runtime.models import LoadedModel


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0
    tls: TlsFiles | None = None  # server certificate (+ CA: require client certificates, mutual TLS)
    token: str | None = None  # bearer token every non-health RPC must carry
    max_message_bytes: int = 4 * 1024 * 1024
    max_concurrent_rpcs: int = 64  # beyond this, calls are answered RESOURCE_EXHAUSTED
    limits: SessionLimits = field(default_factory=SessionLimits)
    max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS  # the largest k a Propose may ask for or a Verify may carry
    max_context_length: int | None = None  # None: the model's own limit

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.max_draft_tokens < 1:
            raise ValueError(f"max_draft_tokens must be >= 1, got {self.max_draft_tokens}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if self.max_concurrent_rpcs < 1:
            raise ValueError(f"max_concurrent_rpcs must be >= 1, got {self.max_concurrent_rpcs}")
        if self.token is not None and len(self.token) < 16:
            raise ValueError("the bearer token must be at least 16 characters")
        if self.max_context_length is not None and self.max_context_length < 2:
            raise ValueError(f"max_context_length must be >= 2, got {self.max_context_length}")


@dataclass(frozen=True)
class ModelConfig:
    model: str  # a model spec (specmesh/runtime/models.py)
    engine: str = "auto"  # "transformers", "llamacpp", "ik", or auto: ik (else llama.cpp) for GGUF models on CPU
    device: str = "auto"
    dtype: str = "auto"
    linear_backend: str = "auto"  # CPU: "onednn" runs linear layers on oneDNN (specmesh/runtime/onednn.py), "torch" does not
    threads: int | None = None
    repack: bool = True  # ik engine: weights repacked at load (about 2x faster; exact: no one-row passes)
    prefix_cache: bool = True  # new sessions start from the cached keys/values of finished ones sharing their prefix
    # Answers independent of the load: a session's logits never depend on other sessions, on how its tokens were
    # split into passes, on a prefix-cache resume or a failover (transformers: fixed-shape chunks, shared by sessions
    # only where checked to round alike; ik: always). Off, the transformers engine runs plain batched passes, and in
    # bfloat16 answers then vary with the load. None: on where the engine has the mode; llamacpp has none (it refuses
    # True).
    deterministic: bool | None = None
    # GGUF engines: run a cached copy of the file with its weights requantized to this type ("q4_0"), or "auto"
    # (q4_0 where the ik engine runs a file with wider weights); None or "none": the file as it is. Drafters take
    # "auto" by default (drafter/cli.py): faster steps, nearly the same drafts (docs/engines.md#a-cheaper-drafter).
    requantize: str | None = None

    def __post_init__(self) -> None:
        if self.requantize is not None:
            from specmesh.runtime.requantize import check_choice

            object.__setattr__(self, "requantize", check_choice(self.requantize))
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.linear_backend not in linear_backends.BACKENDS:
            raise ValueError(f"linear_backend must be one of {', '.join(linear_backends.BACKENDS)}, "
                             f"got {self.linear_backend!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")

    def load(self, server: ServerConfig, preloaded: LoadedModel | None = None, exact: bool = True) -> ModelEngine:
        """The model on its engine, sized for the server's sessions and context (llama.cpp allocates its KV cells
        for them up front, ik_llama.cpp bounds its contexts by them); or `preloaded`, a model already in memory
        (tests, embedding), on the transformers engine.
        `exact=False` (a drafter: its drafts are verified) lets the engine take faster passes whose logits differ in
        rounding from its other passes."""
        if preloaded is not None:
            from specmesh.runtime.transformers_engine import TransformersEngine

            engine = TransformersEngine(preloaded, prefix_cache=self.prefix_cache,
                                        deterministic=self.deterministic is not False)
            log_determinism(engine)
            return engine
        engine = load_engine(self.model, engine=self.engine, device=self.device, dtype=self.dtype,
                             linear_backend=self.linear_backend, threads=self.threads,
                             max_sessions=server.limits.max_sessions, context_length=server.max_context_length,
                             repack=self.repack, prefix_cache=self.prefix_cache, deterministic=self.deterministic,
                             exact=exact, requantize=self.requantize)
        engine.release_tokenizer()  # the worker's own: nothing but the load needed it (a preloaded one may be shared)
        log_determinism(engine)
        return engine


def log_determinism(engine: ModelEngine) -> None:
    """One line at load saying whether answers can vary with the load (docs/engines.md#determinism)."""
    import logging

    logger = logging.getLogger("specmesh.worker")
    if getattr(engine, "deterministic", False):
        logger.info("deterministic: on (answers do not depend on the other requests, the prefix cache or failover)")
    else:
        logger.warning("deterministic: off on the %s engine, %s: greedy and seeded answers may vary with the "
                       "concurrent load%s", engine.engine, engine.dtype,
                       "" if engine.engine == "llamacpp" else " (--deterministic makes them repeat)")


@dataclass(frozen=True)
class FaultInjection:
    inject_latency_s: float = 0.0  # every Propose/Verify first waits this long: a slow worker (chaos tests)
    # The latency starts after this many Propose/Verify calls: a worker that hangs mid-generation while its health
    # still says SERVING (0: from the first call).
    slow_after_calls: int = 0
    _calls: Iterator[int] = field(default_factory=itertools.count, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.inject_latency_s >= 0:
            raise ValueError(f"inject_latency_s must be >= 0, got {self.inject_latency_s}")
        if self.slow_after_calls < 0:
            raise ValueError(f"slow_after_calls must be >= 0, got {self.slow_after_calls}")

    def next_delay(self) -> float:
        """Seconds the next Propose/Verify call (or Decode step) waits before its work (counts the call)."""
        return self.inject_latency_s if next(self._calls) >= self.slow_after_calls else 0.0


def split_options(options: Mapping[str, Any], *configs: type) -> list[dict[str, Any]]:
    """`options` (flat keyword arguments, as run_server takes them) split by which of the dataclasses `configs` has
    a field of that name: one dict per class, in order. A name no class has is a TypeError, as for any function."""
    parts: list[dict[str, Any]] = [{} for _ in configs]
    for name, value in options.items():
        owner = next((i for i, config in enumerate(configs)
                      if name in {f.name for f in dataclasses.fields(config) if f.init}), None)
        if owner is None:
            raise TypeError(f"unexpected option {name!r}")
        parts[owner][name] = value
    return parts


@dataclass(frozen=True)
class BatchingConfig:
    # Calls of different sessions (the verifier's Verify, the drafter's draft steps) run together as one forward pass
    # of up to this many sessions (1: never).
    max_batch_size: int = 8
    # How long a pass may wait for recently answered sessions' next calls to join it (0: never waits).
    max_batch_wait_s: float = 0.02

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if not 0 <= self.max_batch_wait_s <= 10:
            raise ValueError(f"max_batch_wait_s must be in 0..10 seconds, got {self.max_batch_wait_s}")
