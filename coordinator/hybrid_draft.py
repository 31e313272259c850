"""Hybrid drafting: a suffix drafter (drafts from what was generated before, microseconds a round) first, a draft model
where the suffix drafter has nothing long enough.

Per round the suffix drafter is asked first: it drafts only where the recent tokens match something it has seen (this
request's prompt and output, earlier requests' outputs) and drafts longer the longer the match. When its draft has at
least `min_suffix_tokens` tokens (or all k asked for) it is the round's draft; otherwise the draft model's, which costs
c target steps per token and is only used where the cost policy found that it can pay (`model` is None otherwise).
Both drafters learn every committed token. Each draft carries its own distributions (the suffix drafter's point-mass
q, the model's q), so sampling stays exact whichever drafted the round.
"""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.loop import Draft, DraftSource

MIN_SUFFIX_TOKENS = 2  # a one-token suffix draft is a weak match: the model's k tokens are likelier to pay


class HybridDraftSource:
    def __init__(self, suffix: DraftSource, model: DraftSource | None,
                 min_suffix_tokens: int = MIN_SUFFIX_TOKENS, model_max_k: int | None = None) -> None:
        """`model_max_k`: the longest draft the model is asked for (the policy's k follows the suffix drafter's
        near-zero cost; a model draft costs c per token, so its own best k is shorter)."""
        if min_suffix_tokens < 1:
            raise ValueError(f"min_suffix_tokens must be >= 1, got {min_suffix_tokens}")
        if model_max_k is not None and model_max_k < 1:
            raise ValueError(f"model_max_k must be >= 1, got {model_max_k}")
        self.suffix, self.model, self.min_suffix_tokens = suffix, model, min_suffix_tokens
        self.model_max_k = model_max_k
        self.suffix_rounds = 0  # rounds drafted by the suffix drafter
        self.model_rounds = 0  # rounds drafted by the draft model

    def propose(self, k: int, after: Sequence[int] = ()) -> Draft:
        draft = self.suffix.propose(k, after)
        if self.model is None or len(draft.tokens) >= min(self.min_suffix_tokens, k):
            self.suffix_rounds += bool(draft.tokens)
            return draft
        self.model_rounds += 1
        return self.model.propose(min(k, self.model_max_k or k), after)

    def update(self, committed: Sequence[int]) -> None:
        self.suffix.update(committed)
        if self.model is not None:
            self.model.update(committed)

    def end(self) -> None:
        for source in (self.suffix, self.model):
            if source is not None and hasattr(source, "end"):
                source.end()
