"""The engine seam: what the drafter and verifier services need from a model runtime, and how one is chosen."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from specmesh.runtime import catalog

if TYPE_CHECKING:  # the coordinator reads ENGINES from here and must not pay for torch
    import torch

ENGINES = ("auto", "transformers", "llamacpp", "ik")
NO_DETERMINISTIC_LLAMACPP = (
    "the llamacpp engine has no deterministic mode (its passes round differently by shape and share one pool of "
    "KV cells between sessions, so an answer can vary with the load): leave --deterministic out to run it anyway, or "
    "use --engine ik (deterministic per session) or --engine transformers")
T = TypeVar("T")


class CachedTokens(Protocol):
    """One session's token sequence whose keys/values an engine keeps, reused by longest common prefix."""

    cached_tokens: list[int]  # exactly the tokens whose keys/values are cached, in order

    def logits_for(self, sequence: Sequence[int], last_n: int) -> torch.Tensor:
        """Float logits [last_n, vocab] predicting the token after each of the last `last_n` positions of
        `sequence`; afterwards the cache holds the whole `sequence`."""

    def rollback(self, length: int) -> None:
        """Drop the cached keys/values past `length` tokens (explicit KV rollback of rejected drafts)."""

    def reusable_length(self, sequence: Sequence[int], last_n: int) -> int:
        """Cached tokens a `logits_for(sequence, last_n)` call keeps."""

    @property
    def num_bytes(self) -> int:
        """Memory its cached keys/values take."""


class ModelEngine(Protocol):
    """A loaded model and the KV caches of its sessions. Info fields are what the worker reports over the wire."""

    engine: str  # "transformers", "llamacpp" or "ik"
    name: str  # the model spec it was loaded from
    tokenizer: Any  # a transformers tokenizer (text <-> ids, fingerprint, chat template)
    vocab_size: int  # logits width
    eos_token_ids: tuple[int, ...]
    fingerprint: str
    device: str
    dtype: str  # "float32", ..., or a GGUF file type such as "Q5_0"
    has_chat_template: bool
    context_limit: int | None  # longest sequence one session may hold
    max_batch_size: int  # sessions one forward pass can serve (1: no cross-session batching)
    weights_bytes: int  # memory of the weights as loaded
    linear_backend: str  # CPU linear layers, "onednn" or "torch" (specmesh/runtime/onednn.py); "" if no such choice
    deterministic: bool  # a session's logits never depend on the load (other sessions, pass splits, resumes)

    def new_sequence(self) -> CachedTokens: ...

    def release_tokenizer(self) -> None:
        """Free the tokenizer. A worker reads it only while loading (fingerprint, eos ids, chat template, all kept as
        fields); Qwen's 151k-token tokenizer holds about 130 MiB, 5% of the 0.5B drafter's resident memory."""

    def run_on_model_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the thread that runs this model's forward passes. The workers run a whole batch there, the
        logits' sampling and acceptance included: torch work on any other thread (a gRPC handler's argmax over the
        vocabulary) gives that thread an OpenMP team of its own, and with more OpenMP threads than cores libgomp
        stops spin-waiting, which slowed every forward pass by about 25% (specmesh/runtime/model_thread.py)."""

    def batched_logits(self, sequences: Sequence[CachedTokens], requests: Sequence[Sequence[int]],
                       last_ns: Sequence[int]) -> list[torch.Tensor]:
        """`[s.logits_for(r, n) for s, r, n in zip(...)]` in one forward pass; the sequences must be distinct."""


def is_gguf_spec(spec: str) -> bool:
    """Catalog names and .gguf paths: models that exist as GGUF files."""
    return spec in catalog.CATALOG or Path(spec).suffix.lower() == ".gguf"


def llamacpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def ik_available() -> bool:
    """ik_llama.cpp's library loads here (the wheel: x86-64 Linux, AVX2)."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    from specmesh.runtime import ik_binding

    return ik_binding.available()


def auto_engine(spec: str, device: str = "auto", dtype: str = "auto") -> tuple[str, str]:
    """What "auto" picks, and why. GGUF models on CPU run quantized: ik_llama.cpp first (its k-token pass costs far
    less than k steps, and it is exact per session), llama-cpp-python where ik's library does not load, transformers
    where neither is installed. HF models, GPUs and explicit float dtypes run on transformers."""
    from specmesh.runtime.devices import resolve_device

    if not is_gguf_spec(spec):
        return "transformers", f"{spec} is not a GGUF model"
    if resolve_device(device).type != "cpu":
        return "transformers", "the GGUF engines run on CPU here (see docs/engines.md for CUDA builds)"
    if dtype != "auto":
        return "transformers", f"--dtype {dtype} asks for float weights"
    if ik_available():
        return "ik", "GGUF on an x86-64 CPU and ik_llama.cpp loads"
    if llamacpp_available():
        return "llamacpp", "ik_llama.cpp does not load here (ik-llama-cpp-python: x86-64 Linux wheels only)"
    return "transformers", "neither ik-llama-cpp-python nor llama-cpp-python is installed"


def choose_engine(engine: str, spec: str, device: str = "auto", dtype: str = "auto") -> str:
    """Resolve "auto" (see auto_engine); an explicit engine is kept."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    return auto_engine(spec, device, dtype)[0] if engine == "auto" else engine


def as_engine(model: Any) -> ModelEngine:
    """A model engine as is; a transformers LoadedModel (tests, embedding) wrapped in the transformers engine."""
    if hasattr(model, "new_sequence"):
        return model
    from specmesh.runtime.transformers_engine import TransformersEngine

    return TransformersEngine(model)


def load_engine(spec: str, engine: str = "auto", device: str = "auto", dtype: str = "auto",
                linear_backend: str = "auto", threads: int | None = None, max_sessions: int = 64,
                context_length: int | None = None, progress: bool = True, repack: bool = True,
                prefix_cache: bool = True, deterministic: bool | None = None, exact: bool = True,
                requantize: str | None = None) -> ModelEngine:
    """Load `spec` on the chosen engine. `context_length` caps a session's tokens (llama.cpp sizes its KV cache by
    it); `max_sessions` is how many sessions the engine must be able to hold at once; `repack` asks the ik engine for
    run-time repacked weights (about 2x faster), `prefix_cache` whether it resumes sessions from cached prefixes,
    `deterministic` whether answers must not depend on the load (docs/engines.md#determinism): None is on where the
    engine has the mode (transformers; ik always is) and off on llamacpp, which has none (True: ValueError);
    `exact=False` (drafters) lets the ik engine run one-row passes, which round differently from its others;
    `requantize` a type ("q4_0"): a GGUF engine runs a cached copy of the file in it (specmesh/runtime/requantize.py)."""
    chosen = choose_engine(engine, spec, device, dtype)
    if chosen == "transformers" and requantize not in (None, "auto", "none"):
        raise ValueError(f"requantize {requantize} applies to the GGUF engines (ik, llamacpp), not to transformers")
    if deterministic and chosen == "llamacpp":
        raise ValueError(NO_DETERMINISTIC_LLAMACPP)
    if deterministic is None:
        deterministic = chosen != "llamacpp"
    if engine == "auto":
        import logging

        logging.getLogger(__name__).info("engine auto: %s (%s)", chosen, auto_engine(spec, device, dtype)[1])
    if chosen == "ik":
        from specmesh.runtime.ik_engine import IkLlamaEngine

        return IkLlamaEngine.load(spec, device=device, dtype=dtype, threads=threads, max_sessions=max_sessions,
                                  context_length=context_length, progress=progress, repack=repack,
                                  prefix_cache=prefix_cache, exact=exact, requantize=requantize)
    if chosen == "llamacpp":
        from specmesh.runtime.llamacpp_engine import LlamaCppEngine

        return LlamaCppEngine.load(spec, device=device, dtype=dtype, threads=threads, max_sessions=max_sessions,
                                   context_length=context_length, progress=progress, prefix_cache=prefix_cache,
                                   requantize=requantize)
    from specmesh.runtime.models import load_model
    from specmesh.runtime.transformers_engine import TransformersEngine

    return TransformersEngine(load_model(spec, device=device, dtype=dtype, linear_backend=linear_backend,
                                         threads=threads, progress=progress), prefix_cache=prefix_cache,
                              deterministic=deterministic)
