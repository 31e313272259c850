"""Verifier-side acceptance of draft tokens.

Sampled acceptance is speculative sampling (Leviathan et al. 2023, Alg. 1;
Chen et al. 2023): every emitted token is distributed exactly as the target's
warped distribution p, whatever draft distribution q was used, provided q is
the distribution the draft token was actually drawn from.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where a tensor is handled: the coordinator uses Verdict only, and never imports torch
    import torch

from .sampling import SamplingParams, SparseDist, Stream, greedy_argmax, sample_index, uniform, warp_probs


@dataclass(frozen=True)
class Verdict:
    accepted: int  # number of draft tokens accepted (0..k)
    next_token: int  # target's correction at the first rejection, or the bonus token when all k were accepted


def _check_shapes(draft_tokens: Sequence[int], target_logits: torch.Tensor) -> list[int]:
    k = len(draft_tokens)
    if target_logits.dim() != 2 or target_logits.shape[0] != k + 1 or target_logits.shape[1] == 0:
        raise ValueError(
            f"target_logits must have shape [k+1, V] = [{k + 1}, V] for {k} draft tokens, "
            f"got {tuple(target_logits.shape)}"
        )
    vocab = target_logits.shape[1]
    tokens = [operator.index(t) for t in draft_tokens]  # refuses floats
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"draft tokens {bad} out of range for vocab size {vocab}")
    return tokens


def greedy_verdict(draft_tokens: Sequence[int], target_logits: torch.Tensor) -> Verdict:
    """Accept the longest prefix on which the draft equals the target argmax."""
    tokens = _check_shapes(draft_tokens, target_logits)
    best = greedy_argmax(target_logits)  # one device sync for all rows
    for i, t in enumerate(tokens):
        if t != best[i]:
            return Verdict(i, best[i])
    return Verdict(len(tokens), best[-1])


def sampled_verdict(
    draft_tokens: Sequence[int],
    draft_dists: Sequence[SparseDist],
    target_logits: torch.Tensor,
    params: SamplingParams,
    seed: int,
    start_position: int,
) -> Verdict:
    """Speculative sampling over one round of k drafts starting at ``start_position``."""
    tokens = _check_shapes(draft_tokens, target_logits)
    k, vocab = len(tokens), target_logits.shape[1]
    if draft_dists is None or len(draft_dists) != k or not all(isinstance(d, SparseDist) for d in draft_dists):
        raise ValueError(f"sampling needs one SparseDist per draft token ({k}), got {draft_dists!r:.200}")

    p = warp_probs(target_logits, params)  # [k+1, V], one batched warp
    device = p.device
    # p_i(x_i) for every draft at once: a single device->host transfer.
    p_draft = []
    if k:
        import torch

        cols = torch.tensor(tokens, dtype=torch.long, device=device)
        p_draft = p[torch.arange(k, device=device), cols].tolist()

    for i, (x, q) in enumerate(zip(tokens, draft_dists)):
        pos = start_position + i
        qx = q.prob_of(x)
        # Accept with probability min(1, p/q), written as u*q < p to avoid the
        # division.  qx == 0 means x was not drawn from q: reject.
        if qx > 0.0 and uniform(seed, pos, Stream.ACCEPT) * qx < p_draft[i]:
            continue
        # Rejected: sample from the normalised residual max(0, p - q), which is
        # exactly the part of p that q under-covers.
        residual = (p[i] - q.dense(vocab, device)).clamp_min_(0.0)
        if not float(residual.sum()) > 0.0:
            residual = p[i]  # p <= q everywhere (numerically p == q): p itself
        return Verdict(i, sample_index(residual, uniform(seed, pos, Stream.RESAMPLE)))

    # All accepted: the bonus token from the last row.  With k == 0 this is
    # exactly target_sample(target_logits[0], params, seed, start_position).
    return Verdict(k, sample_index(p[k], uniform(seed, start_position + k, Stream.RESAMPLE)))


def decide(
    draft_tokens: Sequence[int],
    draft_dists: Sequence[SparseDist | None] | None,
    target_logits: torch.Tensor,
    params: SamplingParams,
    seed: int,
    start_position: int,
) -> Verdict:
    """Dispatch on the sampling mode; both paths validate their inputs."""
    if params.is_greedy:
        # Greedy drafts carry no distribution; draft_dists is ignored.
        return greedy_verdict(draft_tokens, target_logits)
    return sampled_verdict(draft_tokens, draft_dists, target_logits, params, seed, start_position)
