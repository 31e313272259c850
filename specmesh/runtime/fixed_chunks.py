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
then padding up to the chunk's end, over the session's cached keys/values of [0, s) alone (one session a pass), with
an explicit causal mask. Position p is then always computed with the same query rows, key length and mask,
whatever the split of the passes before it, so its logits and keys/values are bit-identical in a prefill, a decode
step, a k-draft verification, a resume or a failover rebuild. Padding rows come after every real one: the causal
mask keeps them out of the real rows, their keys/values are dropped after the pass. The price: a pass always computes
a whole chunk (a decode step recomputes the chunk's earlier positions), a request that crosses a chunk boundary takes
two passes, and sessions are never batched together. docs/engines.md#determinism has the measured cost.
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
        out = model(input_ids=input_ids, attention_mask=mask[None, None], position_ids=position_ids, cache=self.cache,
                    use_cache=True, logits_to_keep=CHUNK_TOKENS)
        if n < CHUNK_TOKENS:
            self.cache.crop(n - CHUNK_TOKENS)  # the padding's keys/values go (transformers 5: a negative count)
        self.cached_tokens.extend(tokens)
        return out.logits[0, :n, :]
