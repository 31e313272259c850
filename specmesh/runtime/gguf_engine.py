"""What the two GGUF engines share: llama.cpp's (llamacpp_engine.py) and ik_llama.cpp's (ik_engine.py).

Both drive llama.h's C API through ctypes, on one model thread, and hold a session's keys/values as llama cells. They
differ in where a session's cells live: one shared context with a sequence id per session, all sessions in one
`llama_decode` (llama.cpp), or a context per session and a pass per session (ik_llama.cpp, whose batched passes are
wrong; ik_engine.py says why). What does not depend on that is here: a session's cached tokens and their rollback,
the Info fields read from the model, the prefix cache index and its counters, dropped sessions' cells taken back on
the model thread, the lock and the closed check around every pass, and the load from a model spec.
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Self, TypeVar

import torch

from specmesh.runtime.gguf_files import file_type, gguf_engine_inputs
from specmesh.runtime.kv_cache import check_batch, reusable_length
from specmesh.runtime.model_thread import ModelThread
from specmesh.runtime.prefix_cache import PrefixCacheCounters, PrefixIndex

T = TypeVar("T")


class GgufSequence:
    """One session's tokens whose cells a GGUF engine holds, with explicit rollback (the engine removes the cells)."""

    def __init__(self, engine: GgufEngine) -> None:
        self.engine = engine
        self.cached_tokens: list[int] = []
        self.last_used = 0  # engine clock tick of its last pass: the least recently used give their cells up first

    def rollback(self, length: int) -> None:
        if len(self.cached_tokens) > length:
            self.engine.remove_cells(self, length)
            del self.cached_tokens[length:]

    def reusable_length(self, sequence: Sequence[int], last_n: int) -> int:
        return reusable_length(self.cached_tokens, sequence, last_n)

    def logits_for(self, sequence: Sequence[int], last_n: int) -> torch.Tensor:
        return self.engine.batched_logits([self], [sequence], [last_n])[0]

    @property
    def num_bytes(self) -> int:
        return len(self.cached_tokens) * self.engine.kv_bytes_per_token


class GgufEngine(PrefixCacheCounters, ABC):
    """A GGUF model run by a llama.cpp library (specmesh/runtime/engine.py's ModelEngine). A subclass loads the model
    (`_model`, `_vocab`, `_api`), then calls `_set_info`; it says how sessions get their cells (`new_sequence`,
    `_forward`, `remove_cells`, `_take_released`) and frees what it made (`_free`)."""

    runtime: str  # the library, as messages name it: "llama.cpp", "ik_llama.cpp"
    linear_backend = ""  # the library's own kernels: no choice of linear layers to make
    _api: Any  # llama.h's functions, bound with ctypes (llama_cpp's module, or ik_llama.cpp's bound api)
    _model: Any  # llama_model *
    _vocab: Any  # llama_vocab *
    kv_bytes_per_token: int
    build = ""  # what runs, for Info and reports (the library's build; a requantized copy says so)
    # Whether requantize="auto" narrows wide files here: on ik, whose repacked Q4_0 kernels measured fastest
    # (docs/engines.md#a-cheaper-drafter); llama.cpp without its repack ran Q4_0 slower than the shipped K-quants.
    requantize_auto = False

    def __init__(self, thread_name: str, threads: int | None, prefix_cache: bool) -> None:
        # torch only handles a few logits rows here (sampling, acceptance): one thread. Its own OpenMP team would
        # otherwise wake for those small ops and spin on the same cores as the library's threads.
        torch.set_num_threads(1)
        self._thread = ModelThread(thread_name)
        self.threads = threads or len(os.sched_getaffinity(0))
        self.prefix_cache = prefix_cache  # off: a session never starts from another's cells (benchmarks of decoding)
        # Dropped sessions' cells kept for later sessions sharing their prefix, keyed by the engine's handle of them.
        self._prefixes: PrefixIndex[int] = PrefixIndex()
        # (handle, cached tokens) of dropped sessions, not yet taken back on the model thread (`_take_released`).
        self._released: list[tuple[int, list[int]]] = []
        self._clock = 0
        self._lock = threading.RLock()  # every library call; the model thread is the only caller in practice
        self._closed = False

    @classmethod
    def load(cls, spec: str, device: str = "auto", dtype: str = "auto", threads: int | None = None,
             max_sessions: int = 64, context_length: int | None = None, progress: bool = True,
             requantize: str | None = None, **options: Any) -> Self:
        """`spec` (a catalog name or a .gguf path) on this engine; `requantize` a type (e.g. "q4_0"): run a cached
        copy of the file in it (specmesh/runtime/requantize.py; drafters); `options` are the engine's own
        (prefix_cache, and on ik: repack, exact)."""
        path, tokenizer, fingerprint, device = gguf_engine_inputs(cls.runtime, spec, device, dtype, threads, progress)
        if requantize is not None:
            from specmesh.runtime import requantize as requantizing

            if requantize == requantizing.AUTO:
                requantize = requantizing.auto_type(path) if cls.requantize_auto else None
            elif requantize == requantizing.NONE:
                requantize = None
            if requantize is not None:  # the tokenizer (and so the fingerprint) stays the source's
                path = requantizing.requantized(path, requantize)
        engine = cls(spec, path, tokenizer, fingerprint, device=device, threads=threads, max_sessions=max_sessions,
                     context_length=context_length, **options)
        if requantize is not None:
            engine.build = f"{engine.build}, weights requantized to {engine.dtype}".lstrip(", ")
        return engine

    def _set_info(self, spec: str, path: Path, tokenizer: Any, fingerprint: str, device: str, cells: int,
                  n_ctx_train: int) -> None:
        """The Info fields every GGUF engine reads alike, once the model is loaded; `cells` a session may hold."""
        self.name = spec
        self.path = path
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint
        self.vocab_size = self._api.llama_vocab_n_tokens(self._vocab)
        self.eos_token_ids = self._eos_ids(tokenizer)
        self.device = "cpu" if device == "cpu" else "cuda"
        self.dtype = file_type(self._describe())
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))
        self.context_limit = min(cells, n_ctx_train) if n_ctx_train > 0 else cells

    def _describe(self) -> str:
        """llama.cpp's model description: architecture, size, file type ("qwen2 1.5B Q5_K - Medium")."""
        buffer = ctypes.create_string_buffer(256)
        self._api.llama_model_desc(self._model, buffer, ctypes.sizeof(buffer))
        return buffer.value.decode(errors="replace")

    def _eos_ids(self, tokenizer: Any) -> tuple[int, ...]:
        """The GGUF's end-of-sequence and end-of-turn tokens, and the tokenizer's eos (what transformers reads)."""
        ids = {*self._gguf_eos_ids(), getattr(tokenizer, "eos_token_id", None)}
        return tuple(sorted(i for i in ids if i is not None and i >= 0))

    @abstractmethod
    def _gguf_eos_ids(self) -> tuple[int, int]:
        """The model's end-of-sequence and end-of-turn token ids (negative where it has none)."""

    # ------------------------------------------------------------------ sessions

    def cached_prefixes(self) -> list[list[int]]:
        """The token sequences the prefix cache keeps, least recently used first."""
        with self._lock:
            self._take_released()
            return self._prefixes.prefixes()

    def _release_when_dropped(self, sequence: GgufSequence, handle: int) -> weakref.finalize:
        """Once `sequence` is dropped (its session ended, was evicted or expired), hand its cells back with its tokens
        (a prefix cache entry): queued here, taken on the model thread (`_take_released`), never from whichever thread
        happened to drop the last reference. The finalizer holds the token list, not the session."""
        return weakref.finalize(sequence, self._released.append, (handle, sequence.cached_tokens))

    @abstractmethod
    def new_sequence(self) -> GgufSequence: ...

    @abstractmethod
    def remove_cells(self, sequence: GgufSequence, start: int) -> None:
        """Remove a session's cells from position `start` on (its rollback)."""

    @abstractmethod
    def _take_released(self) -> None:
        """Called holding the lock: dropped sessions' cells become prefix cache entries, or are freed."""

    # ------------------------------------------------------------------ forward

    def release_tokenizer(self) -> None:
        self.tokenizer = None

    def run_on_model_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return self._thread.run(fn, *args)

    def batched_logits(self, sequences: Sequence[GgufSequence], requests: Sequence[Sequence[int]],
                       last_ns: Sequence[int]) -> list[torch.Tensor]:
        check_batch(sequences, requests, last_ns, self.context_limit)
        return self._thread.run(self._open_pass, list(sequences), [list(r) for r in requests], list(last_ns))

    def _open_pass(self, sequences: list[GgufSequence], requests: list[list[int]],
                   last_ns: list[int]) -> list[torch.Tensor]:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the {self.runtime} engine is closed")
            self._take_released()
            return self._forward(sequences, requests, last_ns)

    @abstractmethod
    def _forward(self, sequences: list[GgufSequence], requests: list[list[int]],
                 last_ns: list[int]) -> list[torch.Tensor]:
        """Called holding the lock, on the model thread: `batched_logits`, its arguments checked."""

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._free()

    @abstractmethod
    def _free(self) -> None:
        """Free the batch, the contexts and the model (called once, holding the lock)."""
