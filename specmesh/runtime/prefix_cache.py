"""Finished sessions' cached tokens, kept so that a later session sharing their prefix starts from them.

What vLLM calls automatic prefix caching and llama.cpp's server a per-slot prompt cache: turn n of a conversation (or
the next request with the same system prompt) prefills only what it adds. Every engine keeps its own storage (the ik
engine a whole llama context, the llama.cpp engine a sequence id's cells, the transformers engine a DynamicCache) and
uses this index to choose which entry a new session resumes from and which entry to drop first (least recently used).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from specmesh.runtime.kv_cache import reusable_length

H = TypeVar("H")


@dataclass
class CachedPrefix(Generic[H]):
    tokens: list[int]  # exactly the tokens whose keys/values `handle` holds, in order
    handle: H  # the engine's storage of those keys/values
    last_used: int  # tick of the last time it was stored or resumed from: the least recently used go first


class PrefixIndex(Generic[H]):
    """Entries keyed by the engine's handle key; counts hits and reused tokens for `Info` and the metrics."""

    def __init__(self) -> None:
        self._entries: dict[object, CachedPrefix[H]] = {}
        self._clock = itertools.count(1)
        self.hits = 0
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[CachedPrefix[H]]:
        return iter(list(self._entries.values()))

    def add(self, key: object, tokens: list[int], handle: H) -> None:
        self._entries[key] = CachedPrefix(tokens, handle, next(self._clock))

    def longest(self, tokens: Sequence[int], last_n: int) -> tuple[object | None, int]:
        """The entry sharing the longest reusable prefix with a request for the logits of the last `last_n` positions
        of `tokens` (never those positions themselves), and that length; (None, 0) when none shares any."""
        best, best_length = None, 0
        for key, entry in self._entries.items():
            length = reusable_length(entry.tokens, tokens, last_n)
            if length > best_length:
                best, best_length = key, length
        return best, best_length

    def resumed(self, key: object, length: int) -> CachedPrefix[H]:
        """Record that a session starts from the first `length` tokens of entry `key`; the entry."""
        entry = self._entries[key]
        entry.last_used = next(self._clock)
        self.hits += 1
        self.reused_tokens += length
        return entry

    def pop(self, key: object) -> CachedPrefix[H]:
        return self._entries.pop(key)

    def least_recent(self) -> object | None:
        """The key of the least recently used entry; None when there is none."""
        if not self._entries:
            return None
        return min(self._entries, key=lambda k: self._entries[k].last_used)

    def pop_least_recent(self) -> tuple[object, CachedPrefix[H]] | None:
        key = self.least_recent()
        if key is None:
            return None
        return key, self._entries.pop(key)

    def prefixes(self) -> list[list[int]]:
        """The cached token sequences, least recently used first."""
        return [list(e.tokens) for e in sorted(self._entries.values(), key=lambda e: e.last_used)]


class PrefixCacheCounters:
    """An engine's `prefix_hits` and `prefix_reused_tokens` (Info, metrics), read from its `_prefixes` index."""

    _prefixes: PrefixIndex

    @property
    def prefix_hits(self) -> int:
        return self._prefixes.hits

    @property
    def prefix_reused_tokens(self) -> int:
        return self._prefixes.reused_tokens
