"""The transformers engine: a LoadedModel (any HF causal LM, CPU or GPU) behind the engine seam.

Prefix caching: a dropped session's DynamicCache and tokens stay (bounded by PREFIX_CACHE_MAX_BYTES and
PREFIX_CACHE_MAX_ENTRIES, least recently used dropped first); a new session starts from a copy of the entry sharing the
longest prefix of its first request, so it computes only what that request adds. In float32 the keys/values of a
prefix do not depend on how it was split into passes (the k-token pass equals the one-token pass), so the logits
after a resume equal a fresh prefill's.

Deterministic mode (`deterministic=True`, the workers' default: `--deterministic`): every pass computes fixed-shape
chunks (specmesh/runtime/fixed_chunks.py), sessions' chunks sharing a pass only where that is checked to round alike, so a position's logits and keys/values are the same bits
whatever other sessions run, however the sequence was split into passes, after a resume and after a failover
rebuild, in every dtype. Off, sessions are batched into shared passes (faster under load), and in bfloat16 an
answer then varies with the load.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from transformers import DynamicCache

from specmesh.runtime.batched_forward import batched_logits, can_batch
from specmesh.runtime.devices import dtype_name
from specmesh.runtime.file_embedding import file_backed_bytes
from specmesh.runtime import fixed_chunks
from specmesh.runtime.fixed_chunks import ChunkedSequence
from specmesh.runtime.kv_cache import CachedSequence
from specmesh.runtime.models import LoadedModel
from specmesh.runtime.model_thread import ModelThread
from specmesh.runtime.prefix_cache import PrefixCacheCounters, PrefixIndex

T = TypeVar("T")


PREFIX_CACHE_MAX_BYTES = 1 << 30  # keys/values kept for later sessions (1 GiB: ~18k tokens of the 1.5B in float32)
PREFIX_CACHE_MAX_ENTRIES = 16


class _Slot:
    """A session's cache and tokens, held apart from the session so that its finalizer can hand them over."""

    __slots__ = ("cache", "tokens")


class _ThreadedSequence(CachedSequence):
    """A CachedSequence whose forward passes run on its engine's model thread, and whose cache becomes a prefix cache
    entry of the engine when the session is dropped."""

    def __init__(self, engine: TransformersEngine) -> None:
        self._slot = _Slot()
        super().__init__(engine.model)
        self._engine = engine
        weakref.finalize(self, engine._released.append, self._slot)

    cache = property(lambda self: self._slot.cache, lambda self, value: setattr(self._slot, "cache", value))
    cached_tokens = property(lambda self: self._slot.tokens, lambda self, value: setattr(self._slot, "tokens", value))

    def logits_for(self, sequence: Sequence[int], last_n: int) -> torch.Tensor:
        return self._engine._thread.run(self._engine._logits_for, self, list(sequence), last_n)


class _ThreadedChunkedSequence(_ThreadedSequence, ChunkedSequence):
    """A _ThreadedSequence whose passes are fixed-shape chunks (deterministic mode)."""


def _cache_bytes(cache: DynamicCache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if isinstance(t, torch.Tensor))


def weights_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers (oneDNN linears use the layers' own weights, see onednn.py), and of a token
    embedding read from the checkpoint file (file_embedding.py)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}  # tied weights count once
    return sum(t.numel() * t.element_size() for t in tensors.values()) + file_backed_bytes(model)


class TransformersEngine(PrefixCacheCounters):
    engine = "transformers"

    def __init__(self, loaded: LoadedModel, max_batch_size: int = 64, prefix_cache: bool = True,
                 deterministic: bool = False) -> None:
        if deterministic:
            fixed_chunks.check_model(loaded.model)
        self.loaded = loaded
        self.model = loaded.model
        self.name = loaded.name
        self.tokenizer = loaded.tokenizer
        self.vocab_size = loaded.vocab_size
        self.eos_token_ids = loaded.eos_token_ids
        self.fingerprint = loaded.fingerprint
        self.device = str(loaded.device)
        self.dtype = dtype_name(loaded.dtype)
        self.has_chat_template = loaded.has_chat_template
        self.linear_backend = loaded.linear_backend
        self.context_limit = getattr(loaded.model.config, "max_position_embeddings", None)
        self.deterministic = deterministic
        self._thread = ModelThread("transformers-forward")
        # Deterministic: sessions share a pass only as far as that gives each the bits of its own pass (checked on
        # this model and machine: fixed_chunks.sessions_per_shared_pass); else one session a pass.
        if deterministic:
            self.max_batch_size = self._thread.run(fixed_chunks.sessions_per_shared_pass, loaded.model, max_batch_size)
            if self.max_batch_size < max_batch_size:
                logging.getLogger(__name__).info(
                    "deterministic: at most %d session(s) a pass (more would round differently here)",
                    self.max_batch_size)
        else:
            self.max_batch_size = max_batch_size if can_batch(loaded.model) else 1
        self.weights_bytes = weights_bytes(loaded.model)
        self.prefix_cache = prefix_cache  # off: a session never starts from another's cache (benchmarks of decoding)
        self._prefixes: PrefixIndex[DynamicCache] = PrefixIndex()
        self._released: list[_Slot] = []  # dropped sessions' slots, taken into the prefix cache on the model thread
        self._entry_keys = itertools.count()
        self._lock = threading.Lock()

    def cached_prefixes(self) -> list[list[int]]:
        """The token sequences the prefix cache keeps, least recently used first."""
        with self._lock:
            self._take_released()
            return self._prefixes.prefixes()

    def new_sequence(self) -> CachedSequence:
        return _ThreadedChunkedSequence(self) if self.deterministic else _ThreadedSequence(self)

    def _take_released(self) -> None:
        """Dropped sessions' caches become prefix cache entries, within the bounds (least recently used out first)."""
        while self._released:
            slot = self._released.pop()
            if self.prefix_cache and slot.tokens:
                # A key of its own (not id(slot): the slot is freed after this and its id reused).
                self._prefixes.add(next(self._entry_keys), slot.tokens, slot.cache)
        while len(self._prefixes) > PREFIX_CACHE_MAX_ENTRIES or (
                len(self._prefixes) and sum(_cache_bytes(e.handle) for e in self._prefixes) > PREFIX_CACHE_MAX_BYTES):
            self._prefixes.pop_least_recent()

    def _resume(self, sequences: Sequence[CachedSequence], requests: Sequence[Sequence[int]],
                last_ns: Sequence[int]) -> None:
        """Sessions holding nothing start from a copy of the entry sharing the longest prefix of their request (a
        copy: the entry stays for the next session with the same prefix)."""
        with self._lock:
            self._take_released()
            if not self.prefix_cache or not len(self._prefixes):
                return
            for sequence, tokens, last_n in zip(sequences, requests, last_ns):
                if sequence.cached_tokens:
                    continue
                key, length = self._prefixes.longest(tokens, last_n)
                if key is None:
                    continue
                entry = self._prefixes.resumed(key, length)
                cache = DynamicCache(config=self.model.config)
                for index, layer in enumerate(entry.handle.layers):
                    cache.update(layer.keys[:, :, :length].clone(), layer.values[:, :, :length].clone(), index)
                sequence.cache = cache
                sequence.cached_tokens = list(entry.tokens[:length])

    def _logits_for(self, sequence: _ThreadedSequence, tokens: list[int], last_n: int) -> torch.Tensor:
        self._resume([sequence], [tokens], [last_n])
        passes = ChunkedSequence if self.deterministic else CachedSequence
        return passes.logits_for(sequence, tokens, last_n)

    def _batched_logits(self, sequences: Sequence[CachedSequence], requests: Sequence[Sequence[int]],
                        last_ns: Sequence[int]) -> list[torch.Tensor]:
        self._resume(sequences, requests, last_ns)
        if not self.deterministic:
            return batched_logits(self.model, sequences, requests, last_ns)
        # Requests that are one chunk each share a pass; longer ones (prompts) take their own.
        shared = [i for i, (s, r, n) in enumerate(zip(sequences, requests, last_ns)) if fixed_chunks.in_one_chunk(s, r, n)]
        results: list[torch.Tensor | None] = [None] * len(sequences)
        if len(shared) > 1:
            together = fixed_chunks.shared_chunk_logits(self.model, [sequences[i] for i in shared],
                                                        [requests[i] for i in shared], [last_ns[i] for i in shared])
            for i, logits in zip(shared, together):
                results[i] = logits
        for i, (sequence, tokens, last_n) in enumerate(zip(sequences, requests, last_ns)):
            if results[i] is None:
                results[i] = ChunkedSequence.logits_for(sequence, tokens, last_n)
        return results

    def release_tokenizer(self) -> None:
        self.tokenizer = None
        self.loaded = dataclasses.replace(self.loaded, tokenizer=None)

    def run_on_model_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return self._thread.run(fn, *args)

    def batched_logits(self, sequences: Sequence[CachedSequence], requests: Sequence[Sequence[int]],
                       last_ns: Sequence[int]) -> list[torch.Tensor]:
        return self._thread.run(self._batched_logits, sequences, requests, last_ns)
