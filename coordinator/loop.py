"""The speculative decoding loop: flat, gRPC-free, unit-testable.

Each round the drafter proposes k tokens, the target checks all of them in one forward pass and returns how many it
accepts plus one token of its own (the correction at the first rejection, or a bonus token when all were accepted).
With k = 0 a round is plain one-token target decoding: the fallback path and the baseline.

Pipelining (optional, as in PipeSpec/SpecEdge): while the target checks round r's draft, the drafter already drafts
round r+1, betting that every draft is accepted. The bet's first token predicts the target's own (bonus) token; if
all drafts were accepted and that prediction is right, the rest of the bet is exactly what the drafter would propose
next (same context, same position-keyed randomness), so it becomes the next draft without waiting for the drafter.
Output is the same with or without pipelining; only waiting time changes.

Drafting off: where the workers' measured costs say no draft length pays even if every draft is accepted (the cost
policy's DraftingOff, decided before the first round), the generation is plain target decoding and the drafter is
left alone: no session opened, no Propose, no updates. The decision, with its numbers, is logged once and kept in the
result (LoopResult.draft_decision).

Streamed target-only decoding: rounds without drafts are asked of the target as one stream when it can stream them
(StreamingTarget: the verifier's Decode rpc): the whole generation where nothing drafts (no drafter, or drafting
off), and each stretch where the policy keeps k = 0 until its next probe. The tokens are the same as round after
round of k = 0; the verifier decodes back to back instead of waiting a round trip per token. In a generation that
drafts, the stream may also check a guess of the next token in each step where the target's step has a spare row
(LoopConfig.stream_guesses): the same tokens, sometimes two a step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Protocol

from coordinator.drafting.policies import DraftLength

from coordinator.drafting.rounds import RoundRecord
from coordinator.stream_flush import check_stream_flush_s
from specmesh.decoding.acceptance import Verdict
from specmesh.decoding.sampling import SparseDist

log = logging.getLogger("specmesh.coordinator")


@dataclass(frozen=True)
class Draft:
    tokens: tuple[int, ...] = ()
    dists: tuple[SparseDist, ...] = ()  # the distributions the tokens were drawn from; empty when greedy
    source: str = ""  # which draft source drafted it, where a DraftSource combines several (RoundRecord.source)
    # No tokens: the source has nothing to draft now and asks again only after this many tokens; the loop decodes
    # them as one stream where the target streams (0 or 1: the next round asks again).
    wait_tokens: int = 0

    def __post_init__(self) -> None:
        if self.wait_tokens < 0 or (self.wait_tokens and self.tokens):
            raise ValueError(f"wait_tokens must be >= 0, and only on a draft without tokens: {self}")


class DraftSource(Protocol):
    """A drafter session: propose k tokens after the committed history (followed by `after`, tokens not committed:
    pipelining drafts past the draft under verification); learn what got committed."""

    def propose(self, k: int, after: Sequence[int] = ()) -> Draft: ...

    def update(self, committed: Sequence[int]) -> None: ...


class TargetSession(Protocol):
    """A verifier session: check a draft against the target model and commit the outcome."""

    def verify(self, draft: Draft) -> Verdict: ...


class StreamingTarget(TargetSession, Protocol):
    """A verifier session that can also decode on its own, streaming the tokens as it commits them: what max_tokens
    verify(Draft()) calls would give, up to a stop token. Each item is the tokens of one message: one, or with
    flush_interval_s > 0 those the target held up to that long. With `guess`, the target may verify a guess of the next
    token in each step where that costs it nothing (DecodeRequest.guess): the same tokens, sometimes two a step.
    Closing the iterator ends the stream."""

    def decode(self, max_tokens: int, stop_token_ids: frozenset[int],
               flush_interval_s: float = 0.0, guess: bool = False) -> Iterator[list[int]]: ...


@dataclass(frozen=True)
class LoopConfig:
    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    draft_length: DraftLength = DraftLength()
    pipeline: bool = False  # draft the next round while the target verifies this one
    max_propose_tokens: int | None = None  # the drafter's limit: the pipelined bet never asks for more
    stream_target_only: bool = True  # without drafting, let a StreamingTarget decode all tokens in one stream
    # Let the streaming target hold the tokens it commits up to this long and send them in one message: the
    # coordinator's and the verifier's gRPC threads then wake once a message, not once a token (0: every token).
    stream_flush_s: float = 0.0
    # In a generation that drafts (a drafter, even one the cost policy turned off), let the streaming target verify a
    # guess of the next token in each streamed step where that costs it nothing (DecodeRequest.guess). Target-only
    # decoding (no drafter) never guesses: it is the target alone, the baseline.
    stream_guesses: bool = True

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_propose_tokens is not None and self.max_propose_tokens < 1:
            raise ValueError(f"max_propose_tokens must be >= 1, got {self.max_propose_tokens}")
        check_stream_flush_s(self.stream_flush_s)


@dataclass
class LoopResult:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""  # "eos", "length" or "stop"
    rounds: list[RoundRecord] = field(default_factory=list)
    # What the draft-length policy decided before the first round, in words: "fixed k = 4", "adaptive k (cost
    # policy)", "target-only decoding (no drafter)", or why drafting is off ("drafting off: no draft length pays ...").
    draft_decision: str = ""
    drafting_off: bool = False  # the cost policy ruled drafting out for the whole generation (draft_decision says why)
    draft_policy: str = ""  # "cost", "heuristic" or "fixed"; "" without a drafter


def speculative_decode(drafter: DraftSource | None, target: TargetSession, config: LoopConfig,
                       on_tokens: Callable[[list[int]], bool] | None = None,
                       result: LoopResult | None = None) -> LoopResult:
    """Generate up to config.max_new_tokens tokens. `on_tokens(new)` sees each round's committed tokens and returns
    True to stop (stop strings live in text, which only the caller decodes). Pass `result` to keep what was generated
    if a worker fails mid-way: it is filled in place."""
    result = result if result is not None else LoopResult()
    # Drafting off: by the workers' costs no draft length pays even with every draft accepted. Decode target-only and
    # never touch the drafter (no session, no Propose, no update): even an idle drafter session costs the verify time
    # where the two share hardware.
    off = config.draft_length.drafting_off() if drafter is not None else None
    if off is not None:
        log.info("%s; %s", off, off.details())
        drafter = None
    result.drafting_off = off is not None
    result.draft_policy = "" if drafter is None and off is None else (
        config.draft_length.policy if config.draft_length.adaptive else "fixed")
    result.draft_decision = (str(off) if off is not None else "target-only decoding (no drafter)" if drafter is None
                             else config.draft_length.describe())
    streams = config.stream_target_only and hasattr(target, "decode")
    k = config.draft_length.first() if drafter is not None else 0
    pipelined = config.pipeline and drafter is not None
    with ThreadPoolExecutor(1, thread_name_prefix="draft-ahead") if pipelined else nullcontext() as ahead_pool:
        ready: Draft | None = None  # pipelining: the next draft, drafted while the previous round was verified
        while True:
            remaining = config.max_new_tokens - len(result.tokens)
            # The target always adds one token of its own, so never draft past the token budget.
            k_round = min(k, remaining - 1)
            if streams and k_round == 0:
                # No drafts this round, nor (by the policy) in the next ones until its next probe: one stream.
                count = (remaining if drafter is None
                         else config.draft_length.rounds_without_drafts(result.rounds, remaining))
                if _decode_streamed(target, config, count, on_tokens, result, drafter):
                    return result
                k = config.draft_length.next(0, result.rounds)
                continue

            started = time.perf_counter()
            if ready is not None and ready.tokens and k_round > 0:
                # No wait for the drafter this round.
                draft = replace(ready, tokens=ready.tokens[:k_round], dists=ready.dists[:k_round])
            else:
                draft = drafter.propose(k_round) if (drafter is not None and k_round > 0) else Draft()
            ready = None
            if streams and draft.wait_tokens > 1:
                # The drafter has nothing to draft for a while (hybrid drafting: no suffix match, the draft model
                # not paying): decode that stretch as one stream. k stays: the policy did not stop drafting.
                if _decode_streamed(target, config, min(draft.wait_tokens, remaining), on_tokens, result, drafter):
                    return result
                continue
            drafted_at = time.perf_counter()
            # Pipelining: bet that every draft is accepted and draft the round after it meanwhile: the k the policy
            # would choose after a full acceptance, plus 1 token first (the bet's guess of the target's own token).
            ahead = None
            if ahead_pool is not None and draft.tokens and remaining > len(draft.tokens) + 2:
                next_k = config.draft_length.after_full_acceptance(len(draft.tokens), result.rounds,
                                                                   drafted_at - started)
                bet_length = min(next_k + 1, config.draft_length.maximum + 1,
                                 config.max_propose_tokens or config.draft_length.maximum + 1)
                # A next round without drafts has no use for a bet; a bet that costs more than it saves (the policy
                # knows the costs) is not placed.
                if next_k > 0 and config.draft_length.bet_pays(len(draft.tokens), result.rounds):
                    ahead = ahead_pool.submit(drafter.propose, bet_length, draft.tokens)
            verdict = target.verify(draft)
            verified_at = time.perf_counter()
            if ahead is not None:
                bet = ahead.result()
                if verdict.accepted == len(draft.tokens) and bet.tokens[:1] == (verdict.next_token,):
                    ready = Draft(bet.tokens[1:], bet.dists[1:])
            waited_at = time.perf_counter()  # time spent waiting for the bet counts as drafting time

            # Longest agreeing prefix of the draft, plus the target's own token.
            new_tokens = [*draft.tokens[:verdict.accepted], verdict.next_token]
            result.rounds.append(RoundRecord(len(draft.tokens), verdict.accepted,
                                             (drafted_at - started) + (waited_at - verified_at),
                                             verified_at - drafted_at,
                                             bet_won=None if ahead is None else ready is not None,
                                             source=draft.source))
            if drafter is not None:
                drafter.update(new_tokens)

            if _commit(new_tokens, config, on_tokens, result):
                return result

            # Adaptive draft length: decided from the rounds so far (coordinator/drafting/).
            k = config.draft_length.next(k, result.rounds) if drafter is not None else 0


def _commit(new_tokens: list[int], config: LoopConfig, on_tokens: Callable[[list[int]], bool] | None,
            result: LoopResult) -> bool:
    """Add a round's tokens to the result; True (and result.finish_reason set) when the generation is done."""
    # Never emit past an end-of-sequence token (it is kept, like HF generate does).
    finish = ""
    for i, token in enumerate(new_tokens):
        if token in config.eos_token_ids:
            new_tokens, finish = new_tokens[:i + 1], "eos"
            break
    result.tokens.extend(new_tokens)
    if on_tokens is not None and on_tokens(new_tokens):
        finish = "stop"
    if not finish and len(result.tokens) >= config.max_new_tokens:
        finish = "length"
    result.finish_reason = finish
    return bool(finish)


def _decode_streamed(target: StreamingTarget, config: LoopConfig, count: int,
                     on_tokens: Callable[[list[int]], bool] | None, result: LoopResult,
                     drafter: DraftSource | None) -> bool:
    """`count` rounds of k = 0 in one stream from the target, without a round trip per token; True when the
    generation finished (as the loop finishes: an end-of-sequence token is kept; a stop from on_tokens). The drafter
    learns the committed tokens once, at the end."""
    guess = config.stream_guesses and bool(result.draft_policy)
    stream = target.decode(count, config.eos_token_ids, config.stream_flush_s, guess)
    committed: list[int] = []
    try:
        started = time.perf_counter()
        for tokens in stream:
            now = time.perf_counter()
            # Tokens that came together share the wait: each round is one target step, as the policy's costs assume.
            result.rounds.extend(RoundRecord(0, 0, 0.0, (now - started) / len(tokens)) for _ in tokens)
            started = now
            committed.extend(tokens)
            if _commit(tokens, config, on_tokens, result):
                return True
    finally:
        stream.close()  # a stop before the end: the verifier stops decoding
        if drafter is not None and committed:
            drafter.update(committed)
    if len(committed) != count:
        raise RuntimeError(f"the target's stream ended after {len(committed)} of {count} tokens")
    return False
