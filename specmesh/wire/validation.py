"""Request validation shared by both services: every problem becomes a ValueError whose message says what is wrong
(served as gRPC INVALID_ARGUMENT). What a message quotes of the request is `printable` (specmesh/wire/printable.py):
valid UTF-8, no control characters, bounded, so that the status can always be sent."""

from __future__ import annotations

import math
from collections.abc import Sequence

from specmesh.decoding.sampling import SamplingParams, SparseDist
from specmesh.wire.printable import printable

MAX_SESSION_ID_LENGTH = 128
MAX_SEED = 2**64 - 1


def check_session_id(session_id: str) -> None:
    if not session_id:
        raise ValueError("session_id must not be empty")
    if len(session_id) > MAX_SESSION_ID_LENGTH:
        raise ValueError(f"session_id longer than {MAX_SESSION_ID_LENGTH} characters")
    if not session_id.isprintable():
        raise ValueError(f"session_id must be printable text, got '{printable(session_id, 60)}'")


def check_token_ids(name: str, tokens: Sequence[int], vocab_size: int) -> None:
    for i, t in enumerate(tokens):
        if not 0 <= t < vocab_size:
            raise ValueError(f"{name}[{i}] = {t} is outside the vocabulary [0, {vocab_size})")


def check_context(base_length: int, new_tokens: Sequence[int], vocab_size: int, max_context: int) -> None:
    check_token_ids("context.new_tokens", new_tokens, vocab_size)
    if base_length + len(new_tokens) == 0:
        raise ValueError("context is empty: send at least one token of history")
    if base_length + len(new_tokens) > max_context:
        raise ValueError(f"context of {base_length + len(new_tokens)} tokens exceeds max_context_length {max_context}")


def sampling_from_wire(temperature: float, top_k: int, top_p: float) -> SamplingParams:
    # proto3 defaults top_p to 0 when unset: treat 0 as "off", like an absent field.
    return SamplingParams(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p) if top_p else 1.0)


def dist_from_wire(index: int, token_ids: Sequence[int], probs: Sequence[float], vocab_size: int) -> SparseDist:
    where = f"draft_distributions[{index}]"
    if len(token_ids) != len(probs):
        raise ValueError(f"{where}: {len(token_ids)} token_ids but {len(probs)} probs")
    if not token_ids:
        raise ValueError(f"{where} is empty")
    if len(set(token_ids)) != len(token_ids):
        raise ValueError(f"{where} repeats a token id")
    check_token_ids(f"{where}.token_ids", token_ids, vocab_size)
    if any(not math.isfinite(p) or p < 0 for p in probs):
        raise ValueError(f"{where}: probabilities must be finite and non-negative")
    total = math.fsum(probs)
    if abs(total - 1.0) > 1e-3:
        raise ValueError(f"{where}: probabilities sum to {total:.6f}, not 1")
    return SparseDist(tuple(int(t) for t in token_ids), tuple(float(p) for p in probs))
