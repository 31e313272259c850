"""Prompt lookup (n-gram matching): what followed the most recent earlier occurrence of a history's last n tokens
(n = max_ngram down to min_ngram), like HF's `prompt_lookup_num_tokens` and vLLM's ngram speculator. Two users: the
model-free drafter (`drafter serve --method ngram`, drafter/ngram.py) drafts k tokens with it, and the verifier's
streamed steps guess one next token with it in the spare row of the exact ik target's step (verifier/engine.py).

When the match lies so close to the end that fewer than k tokens follow it, the copy runs on through its own proposed
tokens, i.e. it assumes the repetition continues with the same period ("a b a b" proposes "a b a b ..."); HF and vLLM
stop at the end of the history instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specmesh.wire.history import EMPTY_HASH, TokenHistory

DEFAULT_MIN_NGRAM = 1
DEFAULT_MAX_NGRAM = 3


@dataclass(frozen=True)
class NgramConfig:
    min_ngram: int = DEFAULT_MIN_NGRAM
    max_ngram: int = DEFAULT_MAX_NGRAM

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={self.min_ngram}, "
                             f"max_ngram={self.max_ngram}")


def continue_from(tokens: Sequence[int], start: int, k: int) -> list[int]:
    """k tokens copied from tokens[start:], running on through the copy itself past the end (periodic extension)."""
    out: list[int] = []
    n = len(tokens)
    for i in range(k):
        p = start + i
        out.append(tokens[p] if p < n else out[p - n])
    return out


def lookup(tokens: Sequence[int], k: int, min_ngram: int = DEFAULT_MIN_NGRAM,
           max_ngram: int = DEFAULT_MAX_NGRAM) -> list[int]:
    """Reference implementation by linear scan: the proposal for `tokens`, at most k tokens, [] when nothing matches.

    For n = max_ngram down to min_ngram, find the latest start j < len - n with tokens[j:j+n] == tokens[-n:] (an earlier
    occurrence, possibly overlapping the suffix) and copy what follows it. NgramIndex gives the same answer in O(1).
    """
    NgramConfig(min_ngram, max_ngram)
    length = len(tokens)
    if k <= 0:
        return []
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = list(tokens[length - n:])
        for j in range(length - n - 1, -1, -1):
            if list(tokens[j:j + n]) == suffix:
                return continue_from(tokens, j + n, k)
    return []


class NgramIndex:
    """For each n: n-gram -> the position right after its most recent occurrence that has a following token.

    Kept incrementally over a growing history (O(max_ngram) per new token). The history's suffix n-gram is never in
    the index until a token follows it, so a lookup always finds an *earlier* occurrence. Truncation of the history (a
    retried call that builds on a shorter prefix) is noticed through the rolling hash and rebuilds the index.
    """

    def __init__(self, config: NgramConfig = NgramConfig()) -> None:
        self.config = config
        self._maps: dict[int, dict[tuple[int, ...], int]] = {}
        self._indexed = 0  # continuation positions 0.._indexed-1 are in the maps
        self._indexed_hash = EMPTY_HASH  # hash of the history's first _indexed tokens when they were indexed
        self.reset()

    def reset(self) -> None:
        self._maps = {n: {} for n in range(self.config.min_ngram, self.config.max_ngram + 1)}
        self._indexed = 0
        self._indexed_hash = EMPTY_HASH

    def update(self, history: TokenHistory) -> None:
        """Bring the index up to date with `history` (rebuilt from scratch if the history was truncated/changed)."""
        if self._indexed > len(history) or history.hash_at(self._indexed) != self._indexed_hash:
            self.reset()
        self._extend(history.tokens)
        self._indexed_hash = history.hash_at(self._indexed)

    def _extend(self, tokens: Sequence[int]) -> None:
        lo, hi = self.config.min_ngram, self.config.max_ngram
        for j in range(self._indexed, len(tokens)):  # token j follows the n-grams ending just before it
            for n in range(lo, min(hi, j) + 1):
                self._maps[n][tuple(tokens[j - n:j])] = j
        self._indexed = len(tokens)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Same answer as lookup(tokens, k, ...) for the indexed history `tokens`."""
        if k <= 0:
            return []
        for n in range(min(self.config.max_ngram, len(tokens) - 1), self.config.min_ngram - 1, -1):
            start = self._maps[n].get(tuple(tokens[len(tokens) - n:]))
            if start is not None:
                return continue_from(tokens, start, k)
        return []
