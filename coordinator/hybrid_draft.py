"""Hybrid drafting: a suffix drafter (drafts from what was generated before, microseconds a round) first, a draft model
where the suffix drafter has nothing long enough, and only where the draft model pays.

Per round the suffix drafter is asked first: it drafts only where the recent tokens match something it has seen (this
request's prompt and output, earlier requests' outputs) and drafts longer the longer the match. When its draft has at
least `min_suffix_tokens` tokens (or all k asked for) it is the round's draft. Otherwise the draft model may draft:
its drafts cost c target steps per token, so it gets the k its own costs find best (`model_costs`, the workers'
measured costs, with the acceptance of this generation's model rounds so far), and none when that best k is 0. The
round's k (the loop's policy) follows the cheap suffix drafts and bounds both. Both drafters learn every committed
token. Each draft carries its own distributions (the suffix drafter's point-mass q, the model's q), so sampling stays
exact whichever drafted the round.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from coordinator.draft_length import CostEstimate
from coordinator.loop import Draft, DraftSource

MIN_SUFFIX_TOKENS = 2  # a one-token suffix draft is a weak match: the model's k tokens are likelier to pay
PRIOR_WEIGHT = 4  # pseudo-drafts of the prior acceptance in the model rounds' measured acceptance


class HybridDraftSource:
    def __init__(self, suffix: DraftSource, model: DraftSource | None,
                 min_suffix_tokens: int = MIN_SUFFIX_TOKENS, model_costs: CostEstimate | None = None) -> None:
        """`model_costs`: the draft model's and verifier's measured costs (None: the model drafts the round's k)."""
        if min_suffix_tokens < 1:
            raise ValueError(f"min_suffix_tokens must be >= 1, got {min_suffix_tokens}")
        self.suffix, self.model, self.min_suffix_tokens = suffix, model, min_suffix_tokens
        self.model_costs = model_costs
        self.suffix_rounds = 0  # rounds drafted by the suffix drafter
        self.model_rounds = 0  # rounds drafted by the draft model
        self.model_drafted = self.model_accepted = 0
        self._model_draft: tuple[int, ...] | None = None  # the model's draft under verification

    def model_k(self, k: int) -> int:
        """How many tokens the draft model should draft in a round of at most k: the best by its costs at the
        acceptance its rounds have had (the prior's until there are some)."""
        if self.model_costs is None:
            return k
        prior = self.model_costs.acceptance
        acceptance = (self.model_accepted + PRIOR_WEIGHT * prior) / (self.model_drafted + PRIOR_WEIGHT)
        return replace(self.model_costs, acceptance=acceptance, survival=(), tail_acceptance=None).best_k(k)

    def propose(self, k: int, after: Sequence[int] = ()) -> Draft:
        self._model_draft = None
        draft = self.suffix.propose(k, after)
        model_k = self.model_k(k) if self.model is not None else 0
        if model_k == 0 or len(draft.tokens) >= min(self.min_suffix_tokens, k):
            self.suffix_rounds += bool(draft.tokens)
            return draft
        self.model_rounds += 1
        draft = self.model.propose(model_k, after)
        self._model_draft = draft.tokens if not after else None  # a pipelined bet is not this round's draft
        return draft

    def update(self, committed: Sequence[int]) -> None:
        if self._model_draft:  # how much of the model's draft the target kept: the acceptance its k is chosen by
            accepted = 0
            while accepted < min(len(self._model_draft), len(committed)) and \
                    self._model_draft[accepted] == committed[accepted]:
                accepted += 1
            self.model_drafted += len(self._model_draft)
            self.model_accepted += min(accepted, len(committed) - 1)
            self._model_draft = None
        self.suffix.update(committed)
        if self.model is not None:
            self.model.update(committed)

    def end(self) -> None:
        for source in (self.suffix, self.model):
            if source is not None and hasattr(source, "end"):
                source.end()
