"""Hybrid drafting: a suffix drafter (drafts from what was generated before, microseconds a round) first, a draft model
where the suffix drafter has nothing long enough, and only where the draft model pays.

Per round the suffix drafter is asked first: it drafts only where the recent tokens match something it has seen (this
request's prompt and output, earlier requests' outputs) and drafts longer the longer the match. When its draft has at
least `min_suffix_tokens` tokens (or all k asked for) it is the round's draft, and the draft model is not involved:
it stays out of the round's critical path. Otherwise the draft model may draft. Its drafts cost c target steps per
token, so it gets the k its own costs find best (`model_costs`: the workers' measured costs, with the acceptance of
this generation's model rounds so far and the slowdown they measured), and none when that best k is 0.

What the model's rounds measure belongs to the model alone (coordinator/drafting/learned.py): its acceptance, and how
much longer its drafts took than its costs price them (`model_slowdown`: a draft model on cores the verifier shares,
catching up on the tokens the suffix drafter drafted since its last call, restarting its context after a long
stretch without it). A slow model round never makes the suffix drafter's free drafts look expensive.

When neither has a draft, the round would be one target step with a Verify call per token: the hybrid asks the loop
instead to decode the next few tokens as one stream (Draft.wait_tokens), asking the suffix drafter again after 1, 2,
4, ... up to MAX_WAIT_TOKENS tokens while it keeps finding nothing (a match found resets the wait): on text that
repeats nothing, the suffix drafter costs a call every MAX_WAIT_TOKENS tokens and target-only decoding streams.

Both drafters learn every committed token; at the end the suffix drafter is brought up to the whole output (one last
call) so that its tree across requests holds all of it. Each draft carries its own distributions (the suffix
drafter's point-mass q, the model's q), so sampling stays exact whichever drafted the round.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from coordinator.drafting.costs import CostEstimate
from coordinator.loop import Draft, DraftSource

log = logging.getLogger("specmesh.coordinator")

SUFFIX, MODEL = "suffix", "model"  # the sources, as RoundRecord.source and the learned slowdowns name them
MIN_SUFFIX_TOKENS = 2  # a one-token suffix draft is a weak match: the model's k tokens are likelier to pay
PRIOR_WEIGHT = 4  # pseudo-drafts of the prior acceptance in the model rounds' measured acceptance
MAX_WAIT_TOKENS = 16  # nothing to draft: the longest stretch decoded before the suffix drafter is asked again
SLOWDOWN_WINDOW = 8  # recent model rounds whose draft times give the model's slowdown
MIN_SLOWDOWN_ROUNDS = 2  # model rounds (the opening one aside) timed before their slowdown counts
MIN_SLOWDOWN, MAX_SLOWDOWN = 0.5, 4.0


class HybridDraftSource:
    def __init__(self, suffix: DraftSource, model: DraftSource | None,
                 min_suffix_tokens: int = MIN_SUFFIX_TOKENS, model_costs: CostEstimate | None = None,
                 timed: bool = True, clock: Callable[[], float] = time.perf_counter) -> None:
        """`model_costs`: the draft model's and verifier's measured costs, with what earlier generations learned of
        the model's slowdown already in its draft cost (None: the model drafts the round's k, no cost gate).
        `timed`: the model's k may follow its measured slowdown (greedy: a seeded sampled generation repeats exactly
        only where k never depends on timing); the slowdown is measured either way."""
        if min_suffix_tokens < 1:
            raise ValueError(f"min_suffix_tokens must be >= 1, got {min_suffix_tokens}")
        self.suffix, self.model, self.min_suffix_tokens = suffix, model, min_suffix_tokens
        self.model_costs, self.timed = model_costs, timed
        self._clock = clock
        self.suffix_rounds = 0  # rounds drafted by the suffix drafter
        self.model_rounds = 0  # rounds drafted by the draft model
        self.model_drafted = self.model_accepted = 0
        self._model_draft: tuple[int, ...] | None = None  # the model's draft under verification
        # (seconds the model's propose took, seconds its costs price it at), per model round after its first (which
        # opens the drafter session and prefills the prompt: a one-off, like the verifier's prefill)
        self._model_timings: list[tuple[float, float]] = []
        self._misses = 0  # suffix calls in a row that found nothing to draft (the wait before the next one doubles)
        self._unsynced = 0  # tokens committed since the suffix drafter's last call

    def model_slowdown(self) -> float | None:
        """How much longer the model's recent drafts took than `model_costs` price them (catching up included);
        None until MIN_SLOWDOWN_ROUNDS rounds measured it."""
        recent = self._model_timings[-SLOWDOWN_WINDOW:]
        if self.model_costs is None or len(recent) < MIN_SLOWDOWN_ROUNDS:
            return None
        took, priced = sum(t for t, _ in recent), sum(p for _, p in recent)
        return min(max(took / priced, MIN_SLOWDOWN), MAX_SLOWDOWN) if priced > 0 else None

    def model_k(self, k: int) -> int:
        """How many tokens the draft model should draft in a round of at most k: the best by its costs at the
        acceptance its rounds have had (the prior's until there are some), its drafts priced at the slowdown they
        measured."""
        if self.model_costs is None:
            return k
        prior = self.model_costs.acceptance
        acceptance = (self.model_accepted + PRIOR_WEIGHT * prior) / (self.model_drafted + PRIOR_WEIGHT)
        costs = self.model_costs.at_acceptance(acceptance)
        slowdown = self.model_slowdown() if self.timed else None
        return (costs if slowdown is None else costs.with_draft_slowdown(slowdown)).best_k(k)

    def propose(self, k: int, after: Sequence[int] = ()) -> Draft:
        self._model_draft = None
        draft = self.suffix.propose(k, after)
        self._unsynced = 0
        model_k = self.model_k(k) if self.model is not None else 0
        if draft.tokens and (model_k == 0 or len(draft.tokens) >= min(self.min_suffix_tokens, k)):
            self.suffix_rounds += 1
            self._misses = 0
            return replace(draft, source=SUFFIX)
        if model_k == 0:
            self._misses += 1
            return Draft(wait_tokens=min(1 << (self._misses - 1), MAX_WAIT_TOKENS))
        self.model_rounds += 1
        started = self._clock()
        draft = self.model.propose(model_k, after)
        if not after:  # a pipelined bet is not this round's draft
            self._model_draft = draft.tokens
            if self.model_rounds > 1 and self.model_costs is not None:
                costs = self.model_costs
                self._model_timings.append((self._clock() - started,
                                            costs.draft_round_trip_s + model_k * costs.draft_s_per_token))
        return replace(draft, source=MODEL)

    def update(self, committed: Sequence[int]) -> None:
        if self._model_draft:  # how much of the model's draft the target kept: the acceptance its k is chosen by
            accepted = 0
            while accepted < min(len(self._model_draft), len(committed)) and \
                    self._model_draft[accepted] == committed[accepted]:
                accepted += 1
            self.model_drafted += len(self._model_draft)
            self.model_accepted += min(accepted, len(committed) - 1)
            self._model_draft = None
        self._unsynced += len(committed)
        self.suffix.update(committed)
        if self.model is not None:
            self.model.update(committed)

    def end(self) -> None:
        """End both sessions; first bring the suffix drafter up to the whole output (a Propose of one token, its
        draft unused): what a session held when it ends is what its tree across requests learns."""
        try:
            if self._unsynced:
                self.suffix.propose(1)
        except Exception as e:  # noqa: BLE001 - best effort: the generation is over, its output already complete
            log.debug("the suffix drafter's last sync failed: %s", e)
        finally:
            for source in (self.suffix, self.model):
                if source is not None and hasattr(source, "end"):
                    source.end()
