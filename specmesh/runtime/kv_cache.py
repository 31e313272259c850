"""A model's KV cache for one token sequence, reused across calls by longest common prefix, with explicit rollback."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case (the cache is a prefix of the request): one C-level comparison
        return n
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def reusable_length(cached_tokens: Sequence[int], sequence: Sequence[int], last_n: int) -> int:
    """Cached tokens a request for the logits of the last `last_n` positions of `sequence` can keep: the shared
    prefix, but never any of those last `last_n` tokens (their logits must be computed). Every engine's rule."""
    return min(common_prefix_length(cached_tokens, sequence), len(sequence) - last_n)


class CachedSequence:
    """Runs a causal LM over a growing token sequence, keeping the KV cache of the tokens it has already seen.

    `cached_tokens` are exactly the tokens whose keys/values are in the cache, in order. Any request is served by
    rolling the cache back to the longest prefix it shares with the new sequence and running only the rest.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.cached_tokens: list[int] = []

    def rollback(self, length: int) -> None:
        """Drop cached keys/values past `length` tokens (explicit KV rollback of rejected drafts)."""
        excess = len(self.cached_tokens) - length
        if excess > 0:
            self.cache.crop(-excess)  # transformers 5: a negative count removes that many trailing tokens
            del self.cached_tokens[length:]

    def reusable_length(self, sequence: Sequence[int], last_n: int) -> int:
        """Cached tokens a request can keep: the shared prefix, but never any of the last `last_n` tokens, whose
        logits are what the caller wants."""
        return reusable_length(self.cached_tokens, sequence, last_n)

    @torch.inference_mode()
    def logits_for(self, sequence: Sequence[int], last_n: int) -> torch.Tensor:
        """Logits [last_n, V] predicting the token after each of the last `last_n` positions of `sequence`.

        Afterwards the cache holds the whole `sequence`.
        """
        if not 1 <= last_n <= len(sequence):
            raise ValueError(f"last_n={last_n} out of range for a sequence of {len(sequence)} tokens")
        reuse = self.reusable_length(sequence, last_n)
        self.rollback(reuse)
        fresh = torch.tensor([list(sequence[reuse:])], dtype=torch.long, device=self.model.device)
        out = self.model(input_ids=fresh, cache=self.cache, use_cache=True, logits_to_keep=last_n)
        self.cached_tokens.extend(sequence[reuse:])
        return out.logits[0, -last_n:, :]

    @property
    def num_bytes(self) -> int:
        total = 0
        for layer in self.cache.layers:
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        return total


def check_batch(sequences: Sequence, requests: Sequence[Sequence[int]], last_ns: Sequence[int],
                context_limit: int | None) -> None:
    """The arguments of an engine's `batched_logits`: one request and last_n per distinct sequence, each last_n within
    its request, no request longer than the context."""
    if not len(sequences) == len(requests) == len(last_ns):
        raise ValueError("sequences, requests and last_ns must have the same length")
    if len(set(map(id, sequences))) != len(sequences):
        raise ValueError("a sequence may appear only once in a batch")
    for tokens, last_n in zip(requests, last_ns):
        if not 1 <= last_n <= len(tokens):
            raise ValueError(f"last_n={last_n} out of range for a sequence of {len(tokens)} tokens")
        if context_limit is not None and len(tokens) > context_limit:
            raise ValueError(f"{len(tokens)} tokens exceed the context of {context_limit}")
