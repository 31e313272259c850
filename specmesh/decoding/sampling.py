"""Deterministic sampling primitives shared by drafters and the verifier.

Every random decision is driven by ``uniform(seed, position, stream)``: a pure
function of the request seed, the absolute position of the token being chosen
and the purpose of the draw.  Keying randomness by position (not by call
order) makes a request's output independent of how positions are split into
speculation rounds, of retries, and of which worker computed what.
"""

from __future__ import annotations

import bisect
import enum
import hashlib
import itertools
import math
import numbers
import operator
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where a tensor is handled: the coordinator uses the dataclasses only, and never torch
    import torch

_MAX_TEMPERATURE = 100.0
_U64 = 2**64


def _check_index(name: str, value: object, upper: int | None = None) -> int:
    try:
        i = operator.index(value)  # accepts int / numpy ints, refuses floats
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if isinstance(value, bool) or i < 0 or (upper is not None and i >= upper):
        bound = f"[0, {upper})" if upper is not None else ">= 0"
        raise ValueError(f"{name} must be an integer in {bound}, got {value!r}")
    return i


class Stream(enum.IntEnum):
    """Independent random streams per absolute position."""

    DRAFT = 1  # drafter drawing its draft token
    ACCEPT = 2  # verifier's accept/reject coin
    RESAMPLE = 3  # verifier's correction / bonus / target-only sample


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 => greedy
    top_k: int = 0  # 0 => off
    top_p: float = 1.0  # 1 => off

    def __post_init__(self) -> None:
        t = self.temperature
        # bool is an int subclass; True as a temperature is surely a bug.
        if isinstance(t, bool) or not isinstance(t, numbers.Real):
            raise ValueError(f"temperature must be a number, got {t!r}")
        if not (math.isfinite(t) and 0.0 <= t <= _MAX_TEMPERATURE):
            raise ValueError(f"temperature must be finite and in [0, {_MAX_TEMPERATURE}], got {t!r}")
        _check_index("top_k", self.top_k)  # int >= 0
        p = self.top_p
        # The negated comparison also rejects NaN.
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def uniform(seed: int, position: int, stream: Stream) -> float:
    """Deterministic float in [0, 1) from (seed, absolute position, stream).

    Defined as: BLAKE2b (8-byte digest) of the three values packed as
    little-endian uint64, read as a little-endian uint64, top 53 bits / 2**53.
    A hash (rather than seeding a PRNG object) is ~1 us per draw, gives
    independent draws for neighbouring positions/streams, and is trivial to
    reproduce bit-exactly in another language or on another machine.
    """
    seed = _check_index("seed", seed, _U64)
    position = _check_index("position", position, _U64)
    stream = Stream(stream)  # ValueError for unknown streams
    key = seed.to_bytes(8, "little") + position.to_bytes(8, "little") + int(stream).to_bytes(8, "little")
    word = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return (word >> 11) * 2.0**-53


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [..., V] -> float64 probabilities [..., V].

    Order and semantics follow HF transformers: temperature, then top-k, then
    top-p.  Greedy params give a one-hot at the argmax (first index on ties).
    """
    import torch

    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have shape [..., V] with V > 0, got {tuple(logits.shape)}")
    if params.is_greedy:
        out = torch.zeros(logits.shape, dtype=torch.float64, device=logits.device)
        return out.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)

    # float64 throughout: p and q are compared token-wise by the verifier and
    # low-precision softmax would bias those ratios.
    x = logits.to(torch.float64) / params.temperature  # new tensor; caller's logits untouched
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x.masked_fill_(x < kth, -math.inf)  # ties with the k-th value are kept (as HF)
    probs = torch.softmax(x, dim=-1)
    del x

    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # Keep a token iff the mass strictly before it is < top_p: that is the
        # smallest prefix reaching top_p.  The first token has 0 before it, so
        # at least one token always survives.
        before = torch.cumsum(sorted_p, dim=-1).sub_(sorted_p)
        drop_sorted = before >= params.top_p
        drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)
        probs.masked_fill_(drop, 0.0)
        probs.div_(probs.sum(dim=-1, keepdim=True))
    return probs


def _is_tensor(value: object) -> bool:
    """Whether `value` is a torch tensor, without importing torch (a tensor exists only where torch is imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def sample_index(probs: torch.Tensor | Sequence[float], u: float) -> int:
    """Inverse-CDF sample from a 1-D non-negative weight vector using ``u``.

    Weights need not be normalised.  Never returns an index of weight 0.
    A plain sequence (e.g. ``SparseDist.probs``, a few hundred host-side
    floats) takes a pure-Python path with the same rule, avoiding tensor
    round trips that cost more than the arithmetic.
    """
    if not (0.0 <= u < 1.0):
        raise ValueError(f"u must be in [0, 1), got {u!r}")
    if not _is_tensor(probs):
        cdf = list(itertools.accumulate(probs))
        total = cdf[-1] if cdf else 0.0
        if not (math.isfinite(total) and total > 0.0) or min(probs) < 0.0:
            raise ValueError("probs must be finite, non-negative and not all zero")
        idx = bisect.bisect_right(cdf, u * total)
    else:
        import torch

        if probs.dim() != 1 or probs.numel() == 0:
            raise ValueError(f"probs must be a non-empty 1-D tensor, got shape {tuple(probs.shape)}")
        cdf = torch.cumsum(probs, dim=0, dtype=torch.float64)
        total = float(cdf[-1])
        if not (math.isfinite(total) and total > 0.0) or float(probs.min()) < 0.0:
            raise ValueError("probs must be finite, non-negative and not all zero")
        idx = int(torch.searchsorted(cdf, u * total, right=True))
    # idx is the first index whose cdf exceeds u*total.  A zero-weight index
    # has the same cdf as its predecessor (or 0 at index 0), so it is never
    # first; only if u*total rounded up to total can idx run off the end.
    if idx >= len(cdf):  # take the last positive weight
        if _is_tensor(probs):
            idx = int(probs.nonzero().max())
        else:
            idx = max(i for i, w in enumerate(probs) if w > 0)
    return idx


@dataclass(frozen=True)
class SparseDist:
    """A draft distribution as sent on the wire (protobuf ``float`` values).

    ``probs`` are rounded to float32 on construction, so the object holds
    exactly what the receiver will decode; the drafter samples from this same
    object, so the q the verifier sees is exactly the q that was sampled.
    """

    token_ids: tuple[int, ...]
    probs: tuple[float, ...]
    _total: float = field(init=False, repr=False, compare=False)
    _pos: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            ids = tuple(map(operator.index, self.token_ids))  # refuses floats
        except TypeError:
            raise ValueError(f"token_ids must be integers, got {self.token_ids!r:.200}") from None
        # array('f') rounds to float32 exactly as protobuf would; pure Python
        # is faster than numpy/torch for the few hundred entries we carry.
        vals = array("f", self.probs).tolist()
        if not ids or len(ids) != len(vals):
            raise ValueError(f"need equal, non-zero numbers of token_ids ({len(ids)}) and probs ({len(vals)})")
        if len(set(ids)) != len(ids) or min(ids) < 0:
            raise ValueError("token_ids must be unique and non-negative")
        if not all(v >= 0.0 and math.isfinite(v) for v in vals):
            raise ValueError("probs must be finite and non-negative")
        total = math.fsum(vals)  # correctly rounded, so independent of summation order
        if total <= 0.0:
            raise ValueError("probs must not all be zero")
        object.__setattr__(self, "token_ids", ids)
        object.__setattr__(self, "probs", tuple(vals))
        object.__setattr__(self, "_total", total)
        object.__setattr__(self, "_pos", {t: i for i, t in enumerate(ids)})

    def prob_of(self, token_id: int) -> float:
        """Normalised probability of ``token_id`` (0.0 if absent)."""
        i = self._pos.get(token_id)
        # Same float64 division as dense(), so both views agree bit-for-bit.
        return 0.0 if i is None else self.probs[i] / self._total

    def weights(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Un-normalised float64 weights aligned with ``token_ids``."""
        import torch

        return torch.tensor(self.probs, dtype=torch.float64, device=device)

    def dense(self, vocab_size: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Normalised float64 [vocab_size] vector."""
        if max(self.token_ids) >= vocab_size:
            raise ValueError(f"token id {max(self.token_ids)} out of range for vocab_size {vocab_size}")
        import torch

        out = torch.zeros(vocab_size, dtype=torch.float64, device=device)
        ids = torch.tensor(self.token_ids, dtype=torch.long, device=device)
        out[ids] = self.weights(device) / self._total
        return out


def truncate_distribution(probs: torch.Tensor, top_p: float = 0.999, max_entries: int = 256) -> SparseDist:
    """Keep the most likely tokens until their mass reaches ``top_p`` (or
    ``max_entries``), rounded to float32 for the wire.

    Truncation is not an approximation for correctness: the drafter samples
    from the truncated distribution itself, and speculative sampling is exact
    for any q it is given.  It only lowers acceptance slightly.
    """
    import torch

    if probs.dim() != 1 or probs.numel() == 0:
        raise ValueError(f"probs must be a non-empty 1-D tensor, got shape {tuple(probs.shape)}")
    if not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    max_entries = _check_index("max_entries", max_entries)
    if max_entries < 1:
        raise ValueError("max_entries must be >= 1")
    # topk (not a full sort): V may be ~150k while we keep a few hundred.
    vals, ids = torch.topk(probs, min(max_entries, probs.numel()))
    cum = torch.cumsum(vals, dim=0, dtype=torch.float64)
    total = float(probs.sum(dtype=torch.float64))
    if not (math.isfinite(total) and total > 0.0):
        raise ValueError("probs must be finite and not all zero")
    # Smallest prefix whose mass reaches top_p (first cum >= top_p * total).
    keep = min(int(torch.searchsorted(cum, top_p * total)) + 1, vals.numel())
    # Renormalise the kept mass before rounding, so what travels sums to 1 (up to float32 rounding) and receivers
    # can check it; the distribution itself is unchanged (SparseDist normalises by the sum anyway).
    kept = vals[:keep].to(torch.float64)
    vals32 = array("f", (kept / kept.sum()).tolist()).tolist()
    # Sorted descending, so entries that are (or round to) zero form a suffix;
    # they could never be drawn, so don't ship them.  The top one is > 0.
    while len(vals32) > 1 and vals32[-1] == 0.0:
        vals32.pop()
    return SparseDist(tuple(ids[: len(vals32)].tolist()), tuple(vals32))


@dataclass(frozen=True)
class DraftSample:
    token: int
    dist: SparseDist | None  # None when greedy


def _check_vector(logits: torch.Tensor) -> None:
    if logits.dim() != 1 or logits.numel() == 0:
        raise ValueError(f"logits must be a non-empty 1-D tensor [V], got shape {tuple(logits.shape)}")


def greedy_argmax(logits: torch.Tensor) -> list[int] | int:
    """The argmax over the last dimension (the first index on ties, as torch.argmax): a list for a [rows, V] tensor,
    an int for a vector. CPU float32/float64 logits go through numpy, whose argmax over a 150k vocabulary takes a
    tenth of a single-threaded torch.argmax's time (10 against 130 us), time every greedy step of the verifier and the
    drafter pays between two forward passes. Both return the same index, NaN included (the first NaN counts as the
    maximum)."""
    import torch

    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64) and not logits.requires_grad:
        best = logits.numpy().argmax(axis=-1)
    else:
        best = logits.argmax(dim=-1)
    return best.tolist()


def draft_sample(
    logits: torch.Tensor,
    params: SamplingParams,
    seed: int,
    position: int,
    top_p: float = 0.999,
    max_entries: int = 256,
) -> DraftSample:
    """Drafter's choice for ``position`` plus the distribution it drew from."""
    _check_vector(logits)
    if params.is_greedy:
        return DraftSample(greedy_argmax(logits), None)
    q = truncate_distribution(warp_probs(logits, params), top_p, max_entries)
    i = sample_index(q.probs, uniform(seed, position, Stream.DRAFT))
    return DraftSample(q.token_ids[i], q)


def target_sample(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """Plain (k = 0) decoding step; identical to a speculative round with no drafts."""
    _check_vector(logits)
    if params.is_greedy:
        return greedy_argmax(logits)
    return sample_index(warp_probs(logits, params), uniform(seed, position, Stream.RESAMPLE))
