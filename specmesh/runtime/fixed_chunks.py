"""Deterministic passes: every position's logits and keys/values computed in a pass of one fixed shape.

Why: in a forward pass, a position's result depends on the shape of the pass it was computed in, not only on the
tokens before it. Measured on the tiny models (torch 2.13, sdpa, 2-core Xeon with AMX): the linear layers give each
row the same bits whatever the row count, but torch's CPU attention does not. It reduces every query over all the
pass's key columns, masked ones included, in blocks and vector lanes laid out by the pass's key length (and, under
`is_causal`, by the query block's end). So a position computed in a 60-token prefill, in a 31-token one, in a
1-token decode step, after a prefix-cache resume, or next to other sessions (whose padding widens the batch) gets
different rounding: 2 of 60 positions bit-identical to one-token passes in bfloat16, 0 of 60 in float32. In float32
the differences are ~1e-6 and rarely flip a choice; in bfloat16 they are ~1e-2 and flip near-ties, so an answer
depended on the other requests in flight, on the draft length, on the prefix cache and on failover.

The fix, by construction rather than by kernel: a session's positions are cut into chunks of CHUNK_TOKENS from
position 0, and every pass computes exactly one whole chunk [s, s + CHUNK_TOKENS): the tokens the session has there,
then padding up to the chunk's end, over the session's cached keys/values of [0, s) alone, with an explicit causal
mask. Position p is then always computed with the same query rows, key length and mask,
whatever the split of the passes before it, so its logits and keys/values are bit-identical in a prefill, a decode
step, a k-draft verification, a resume or a failover rebuild. Padding rows come after every real one: the causal
mask keeps them out of the real rows, their keys/values are dropped after the pass. The price: a pass always computes
a whole chunk (a decode step recomputes the chunk's earlier positions), and a request that crosses a chunk boundary
takes two passes. docs/engines.md#determinism has the measured cost.

Sessions still share passes (shared_chunk_logits): each session's chunk is a row, and attention runs row by row over
that session's own key columns (_rowwise_sdpa), so its attention has exactly the shapes of its own pass. What is
shared are the row-wise layers (linear layers, norms, the MLP), whose rows are independent: a row's bits then depend
only on whether the kernels give a row the same bits whatever the row count. That is measured, not assumed: at load,
can_share_passes compares shared and own passes on the model itself, and where they differ (another CPU, cuBLAS's
shape-dependent split-K on a GPU) every session takes passes of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specmesh.runtime.kv_cache import CachedSequence

# Positions per pass. Large enough that a verification of a few drafts seldom crosses a chunk boundary (a
# window of n positions crosses one with probability (n - 1) / CHUNK_TOKENS), small enough that a decode step's
# recomputed rows cost little where reading the weights dominates. At most torch's CPU attention's smallest query
# block (32), so that a chunk is one query block.
CHUNK_TOKENS = 16
PAD_TOKEN = 0  # any id: padding rows' outputs are never used
# A forward pass's keyword naming, per batch row, the first key column of that row's session (the columns before it
# are another session's padding): attention then runs row by row over the session's own columns (_rowwise_sdpa).
ROW_KEYS_FROM = "specmesh_row_keys_from"


def chunk_start(position: int) -> int:
    return position - position % CHUNK_TOKENS


def check_model(model: torch.nn.Module) -> None:
    """Deterministic passes give the model an explicit 4D mask: only sdpa/eager attention over full-attention layers
    takes one (as for cross-session batching, specmesh/runtime/batched_forward.py)."""
    from specmesh.runtime.batched_forward import can_batch

    if not can_batch(model):
        attention = getattr(model.config, "_attn_implementation", None)
        raise ValueError(f"deterministic passes need sdpa or eager attention over full-attention layers; this model "
                         f"has {attention!r} attention and layers {getattr(model.config, 'layer_types', None)}: "
                         "run it with --no-deterministic")


def _rowwise_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention, run row by row over each row's own key columns when the pass names them: a
    session's attention then has the shapes of its own pass, whatever other sessions share the batch (their
    padding would otherwise widen its key length, and so change its rounding). Passes that do not name them (the
    --no-deterministic engines, other code) get the plain function."""
    keys_from = kwargs.pop(ROW_KEYS_FROM, None)
    if keys_from is None or attention_mask is None:
        return _PLAIN_SDPA(module, query, key, value, attention_mask, **kwargs)
    rows = [_PLAIN_SDPA(module, query[row:row + 1].contiguous(), key[row:row + 1, :, first:].contiguous(),
                        value[row:row + 1, :, first:].contiguous(),
                        attention_mask[row:row + 1, :, :, first:].contiguous(), **kwargs)[0]
            for row, first in enumerate(keys_from)]
    return torch.cat(rows), None


_PLAIN_SDPA = None


def _install_rowwise_sdpa() -> None:
    """Wrap transformers' "sdpa" attention with _rowwise_sdpa, once per process (AttentionInterface.register, the
    library's own way to replace an attention function)."""
    global _PLAIN_SDPA
    if _PLAIN_SDPA is not None:
        return
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    _PLAIN_SDPA = sdpa_attention_forward
    AttentionInterface.register("sdpa", _rowwise_sdpa)


def _rowwise(model: torch.nn.Module) -> bool:
    """Whether the model's attention is sdpa, which deterministic passes run row by row (installed on first use)."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    _install_rowwise_sdpa()
    return True


MAX_SHARED_SESSIONS = 8  # the most sessions a deterministic pass is checked for (and so may share)


def sessions_per_shared_pass(model: torch.nn.Module, most: int) -> int:
    """How many sessions' chunks may share a pass, up to `most` and MAX_SHARED_SESSIONS (1: none). It takes sdpa
    attention (run row by row, _rowwise_sdpa) and linear layers that give a row the same bits whatever the row
    count up to that many chunks. The second is a property of the kernels, not guaranteed: oneDNN's bf16 linears on
    a Xeon with AMX keep a row's bits up to 32 rows (two chunks) and change kernels beyond, at the real models'
    widths; cuBLAS picks split-K by shape. So it is checked here, on the model itself: shared passes of 2, 3, ...
    sessions of different lengths against each session's own passes, up to the first count that differs."""
    if min(most, MAX_SHARED_SESSIONS) < 2 or not _rowwise(model):
        return 1
    vocab = model.config.vocab_size
    # One or two chunks each, of different lengths (so the shared pass pads their keys differently).
    histories = [[(31 * s + 7 * i + 3) % vocab for i in range(3 + (s * 5) % 26)] for s in range(MAX_SHARED_SESSIONS)]
    prefixes, alone = [], []

    def copy(sequence: ChunkedSequence) -> ChunkedSequence:
        twin = ChunkedSequence(model)
        for index, layer in enumerate(sequence.cache.layers):
            twin.cache.update(layer.keys.clone(), layer.values.clone(), index)
        twin.cached_tokens = list(sequence.cached_tokens)
        return twin
    for sessions in range(2, min(most, MAX_SHARED_SESSIONS) + 1):
        while len(alone) < sessions:
            history = histories[len(alone)]
            prefix = ChunkedSequence(model)
            prefix.logits_for(history[:-1], 1)
            prefixes.append(prefix)
            alone.append(copy(prefix).logits_for(history, 1))
        together = shared_chunk_logits(model, [copy(p) for p in prefixes[:sessions]], histories[:sessions],
                                       [1] * sessions)
        if not all(torch.equal(a, b) for a, b in zip(alone, together)):
            return sessions - 1
    return min(most, MAX_SHARED_SESSIONS)


def in_one_chunk(sequence: CachedSequence, tokens: Sequence[int], last_n: int) -> bool:
    """Whether a request's pass is a single chunk (what shared_chunk_logits takes)."""
    return len(tokens) <= chunk_start(sequence.reusable_length(tokens, last_n)) + CHUNK_TOKENS


@torch.inference_mode()
def shared_chunk_logits(model: torch.nn.Module, sequences: Sequence[ChunkedSequence],
                        requests: Sequence[Sequence[int]], last_ns: Sequence[int]) -> list[torch.Tensor]:
    """Like `[s.logits_for(r, n) ...]` for requests that are each one chunk (in_one_chunk), in one pass whose rows
    are the sessions' chunks: the same bits as their own passes where can_share_passes(model)."""
    from specmesh.runtime.batched_forward import _padded_cache, _store_row

    starts = [chunk_start(s.reusable_length(r, n)) for s, r, n in zip(sequences, requests, last_ns)]
    fresh = []
    for sequence, tokens, start in zip(sequences, requests, starts):
        if len(tokens) > start + CHUNK_TOKENS:
            raise ValueError("a request of several chunks cannot share a pass")
        sequence.rollback(start)
        fresh.append(list(tokens[start:]))
    batch, l_max, device = len(sequences), max(starts), model.device
    input_ids = torch.full((batch, CHUNK_TOKENS), PAD_TOKEN, dtype=torch.long, device=device)
    position_ids = torch.zeros(batch, CHUNK_TOKENS, dtype=torch.long, device=device)
    allowed = torch.zeros(batch, 1, CHUNK_TOKENS, l_max + CHUNK_TOKENS, dtype=torch.bool, device=device)
    causal = torch.ones(CHUNK_TOKENS, CHUNK_TOKENS, dtype=torch.bool, device=device).tril()
    for row, (tokens, start) in enumerate(zip(fresh, starts)):
        input_ids[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        position_ids[row] = torch.arange(start, start + CHUNK_TOKENS)
        allowed[row, 0, :, l_max - start:l_max] = True
        allowed[row, 0, :, l_max:] = causal
    dtype = next(model.parameters()).dtype
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    cache = _padded_cache(model, sequences, l_max)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, cache=cache, use_cache=True,
                logits_to_keep=CHUNK_TOKENS, **{ROW_KEYS_FROM: [l_max - start for start in starts]})
    results = []
    for row, (sequence, tokens, start, request, last_n) in enumerate(zip(sequences, fresh, starts, requests,
                                                                           last_ns)):
        _store_row(model, sequence, cache, row, l_max - start, l_max + len(tokens))
        sequence.cached_tokens.extend(tokens)
        wanted = len(request) - last_n - start
        results.append(out.logits[row, wanted:len(tokens), :])
    return results


class ChunkedSequence(CachedSequence):
    """A CachedSequence whose every forward pass is one fixed-shape chunk (see the module docstring)."""

    @torch.inference_mode()
    def logits_for(self, sequence: Sequence[int], last_n: int) -> torch.Tensor:
        if not 1 <= last_n <= len(sequence):
            raise ValueError(f"last_n={last_n} out of range for a sequence of {len(sequence)} tokens")
        start = chunk_start(self.reusable_length(sequence, last_n))
        self.rollback(start)
        wanted_from = len(sequence) - last_n
        rows = []
        for chunk in range(start, len(sequence), CHUNK_TOKENS):
            tokens = list(sequence[chunk:chunk + CHUNK_TOKENS])
            logits = self._pass(chunk, tokens)
            first = max(wanted_from - chunk, 0)
            if first < len(tokens):
                rows.append(logits[first:len(tokens)])
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def _pass(self, start: int, tokens: list[int]) -> torch.Tensor:
        """One chunk's pass over the cache of [0, start): the logits of its `tokens`; afterwards the cache holds them."""
        n, model = len(tokens), self.model
        device = model.device
        input_ids = torch.full((1, CHUNK_TOKENS), PAD_TOKEN, dtype=torch.long, device=device)
        input_ids[0, :n] = torch.tensor(tokens, dtype=torch.long)
        position_ids = torch.arange(start, start + CHUNK_TOKENS, device=device).unsqueeze(0)
        allowed = torch.ones(CHUNK_TOKENS, start + CHUNK_TOKENS, dtype=torch.bool, device=device).tril(start)
        dtype = next(model.parameters()).dtype
        # Additive form, as in batched_forward: accepted by both sdpa and eager attention.
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
        # sdpa: through _rowwise_sdpa, the very code a shared pass runs for this session's row.
        rowwise = {ROW_KEYS_FROM: [0]} if _rowwise(model) else {}
        out = model(input_ids=input_ids, attention_mask=mask[None, None], position_ids=position_ids, cache=self.cache,
                    use_cache=True, logits_to_keep=CHUNK_TOKENS, **rowwise)
        if n < CHUNK_TOKENS:
            self.cache.crop(n - CHUNK_TOKENS)  # the padding's keys/values go (transformers 5: a negative count)
        self.cached_tokens.extend(tokens)
        return out.logits[0, :n, :]
