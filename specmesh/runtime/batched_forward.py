"""One target forward pass over several sessions at once, each keeping its own KV cache.

Cross-session batching (what vLLM calls continuous batching, here only for verification): a target forward over a few
tokens is bound by reading the weights, not by arithmetic, so verifying B sessions' drafts in one pass costs far less
than B passes. Each session's cache has its own length, so the batch is laid out, per row i, as

    [ left padding | cache_i (L_i tokens) | fresh_i (n_i tokens) | right padding ]
    |<------------- L_max columns ------->|<------- N_max columns ------------->|

The KV of cache_i and fresh_i end up adjacent, so afterwards each row's new cache is ONE slice of the batched one.
The attention mask is built here, explicitly, as a 4D tensor: padding columns are never attended to, fresh tokens
attend causally among themselves, and position ids count each row's own tokens (L_i + j), so every row computes what
it would compute alone (up to float rounding of differently shaped matmuls). Right-padding queries always see at least
their row's first fresh token, so no attention row is fully masked (which would produce NaNs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from specmesh.runtime.kv_cache import CachedSequence

if TYPE_CHECKING:
    from transformers import DynamicCache

# Batched rows get logits for every fresh column (the rows' wanted positions differ), so a row that brings a long
# prompt would make a [B, N_max, vocab] tensor; such rows (a prefill) are computed on their own instead.
MAX_BATCHED_FRESH_TOKENS = 64


def can_batch(model: torch.nn.Module) -> bool:
    """Only models whose attention takes our explicit 4D mask and whose caches are plain full-attention layers."""
    config = model.config
    attention = getattr(config, "_attn_implementation", None)
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    return attention in ("sdpa", "eager") and layer_types == {"full_attention"}


def fresh_length(sequence: CachedSequence, tokens: Sequence[int], last_n: int) -> int:
    """How many tokens a `logits_for(tokens, last_n)` call would have to run through the model."""
    return len(tokens) - sequence.reusable_length(tokens, last_n)


@torch.inference_mode()
def batched_logits(model: torch.nn.Module, sequences: Sequence[CachedSequence], requests: Sequence[Sequence[int]],
                   last_ns: Sequence[int]) -> list[torch.Tensor]:
    """Like `[s.logits_for(r, n) for s, r, n in zip(sequences, requests, last_ns)]`, in one forward pass.

    The sequences must be distinct objects (one row each). Afterwards every cache holds its whole request.
    """
    if not len(sequences) == len(requests) == len(last_ns):
        raise ValueError("sequences, requests and last_ns must have the same length")
    if len(set(map(id, sequences))) != len(sequences):
        raise ValueError("a sequence may appear only once in a batch")
    if len(sequences) == 1:
        return [sequences[0].logits_for(requests[0], last_ns[0])]

    fresh: list[list[int]] = []
    for sequence, tokens, last_n in zip(sequences, requests, last_ns):
        if not 1 <= last_n <= len(tokens):
            raise ValueError(f"last_n={last_n} out of range for a sequence of {len(tokens)} tokens")
        reuse = sequence.reusable_length(tokens, last_n)
        sequence.rollback(reuse)
        fresh.append(list(tokens[reuse:]))
    cache_lengths = [len(s.cached_tokens) for s in sequences]
    batch, l_max, n_max = len(sequences), max(cache_lengths), max(map(len, fresh))
    device = model.device

    input_ids = torch.zeros(batch, n_max, dtype=torch.long, device=device)  # padding id 0: its output is ignored
    position_ids = torch.zeros(batch, n_max, dtype=torch.long, device=device)
    allowed = torch.zeros(batch, 1, n_max, l_max + n_max, dtype=torch.bool, device=device)
    causal = torch.ones(n_max, n_max, dtype=torch.bool, device=device).tril()
    for row, (tokens, cached) in enumerate(zip(fresh, cache_lengths)):
        n = len(tokens)
        input_ids[row, :n] = torch.tensor(tokens, dtype=torch.long)
        position_ids[row] = torch.arange(cached, cached + n_max)  # padding positions continue the count; unused
        allowed[row, 0, :, l_max - cached:l_max] = True  # every query sees the row's whole cache
        allowed[row, 0, :, l_max:l_max + n] = causal[:, :n]  # and the fresh tokens up to itself
    dtype = next(model.parameters()).dtype
    # Additive form: accepted by both the sdpa and the eager attention of transformers.
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)

    cache = _padded_cache(model, sequences, l_max)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, cache=cache, use_cache=True,
                logits_to_keep=n_max)

    results = []
    for row, (sequence, tokens, cached, last_n) in enumerate(zip(sequences, fresh, cache_lengths, last_ns)):
        n = len(tokens)
        _store_row(model, sequence, cache, row, l_max - cached, l_max + n)
        sequence.cached_tokens.extend(tokens)
        results.append(out.logits[row, n - last_n:n, :])
    return results


def _padded_cache(model: torch.nn.Module, sequences: Sequence[CachedSequence], l_max: int) -> DynamicCache:
    """A batch cache holding each sequence's keys/values right-aligned in `l_max` columns (zeros to the left)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    if l_max == 0:
        return cache
    donor = next(s for s in sequences if s.cached_tokens)  # any row with a cache gives the per-layer shapes
    for index, donor_layer in enumerate(donor.cache.layers):
        _, heads, _, key_dim = donor_layer.keys.shape  # [1, heads, length, dim]
        keys = donor_layer.keys.new_zeros((len(sequences), heads, l_max, key_dim))
        values = donor_layer.values.new_zeros((len(sequences), heads, l_max, donor_layer.values.shape[-1]))
        for row, sequence in enumerate(sequences):
            length = len(sequence.cached_tokens)
            if length:
                keys[row, :, l_max - length:] = sequence.cache.layers[index].keys[0]
                values[row, :, l_max - length:] = sequence.cache.layers[index].values[0]
        cache.update(keys, values, index)
    return cache


def _store_row(model: torch.nn.Module, sequence: CachedSequence, batch_cache: DynamicCache, row: int, start: int,
               stop: int) -> None:
    """Give `sequence` its own copy of columns [start, stop) of `row` (a copy, so the batch tensors can be freed)."""
    from transformers import DynamicCache

    own = DynamicCache(config=model.config)
    for index, layer in enumerate(batch_cache.layers):
        own.update(layer.keys[row:row + 1, :, start:stop].clone(), layer.values[row:row + 1, :, start:stop].clone(),
                   index)
    sequence.cache = own
