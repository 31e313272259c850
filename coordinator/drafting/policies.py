"""How many tokens to draft next round, from what the previous rounds measured.

Every policy answers two questions (the DraftPolicy protocol): the first round's k, and the next round's k after the
rounds so far. `POLICIES` names the adaptive ones a user may choose:
- "heuristic" (Hugging Face's): +2 after a round where every draft was accepted, -1 otherwise.
- "cost": the speculative decoding cost model says whether drafting pays, and the run says how long to draft. A
  round with k drafts commits E(k) tokens and costs k*c + v(k): c the drafter's seconds per token, v(k) the verify's
  seconds for k drafts (the verifier's measured curve, see CostEstimate.verify_curve), E(k) from this generation's
  measured acceptance. After a fully accepted round it drafts 2 more (HF's rule: the drafter is following the text,
  and bursty runs last longer than any average predicts) where a run can pay for its drafts (run_acceptance); after
  a rejection it keeps drafting (one fewer) while the recent drafted rounds' realised rate, priced by the model, is
  at least target-only's, and falls back to k = 0 (plain target decoding) otherwise, probing with a small draft now
  and then to notice when drafting pays again, each probe that finds nothing doubling the wait for the next
  (drafting_pays, failed_probes). Where the model's own best k is longer (cheap drafts), it drafts that. Unlike the
  heuristic it knows what a draft token and a wider verify pass COST here: where drafting cannot pay even at
  PLAUSIBLE_ACCEPTANCE (a slow drafter, a verifier whose cost grows with every draft), it never starts: with the
  workers' costs (the prior, fixed for the generation) that is decided before the first round (drafting_off,
  DraftingOff) and the generation never drafts, never probes and leaves the drafter alone (coordinator/loop.py).
  Where drafting pays at PLAUSIBLE_ACCEPTANCE but not at the prior's, the first round drafts nothing and the first
  probe measures this text's acceptance: exploring costs a round, not three rounds of long drafts.
A fixed k (`DraftLength.fixed`) is the third, non-adaptive policy.

Policies are pure functions of the round history, so they are unit-testable and keep no state of their own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Protocol

from coordinator.drafting.costs import PLAUSIBLE_ACCEPTANCE, CostEstimate, CostsPending, DraftingOff
from coordinator.drafting.estimators import (MIN_DRAFTED_ROUNDS, estimate_costs, failed_probes,
                                             measured_acceptance, measured_bet_hit, measured_bet_slowdown,
                                             measured_drafting_slowdown, measured_survival, measured_tail_acceptance,
                                             recent_drafted, run_acceptance)
from coordinator.drafting.rounds import RoundRecord

DEFAULT_POLICY = "cost"
PROBE_EVERY = 8  # with k = 0 chosen, one round in this many drafts `minimum` tokens to keep measuring acceptance
# With k = 0 chosen because drafting could not pay even if every draft were accepted (a slow drafter, a verifier whose
# cost grows with every draft), acceptance is not worth measuring: probe only this rarely, to notice changed costs.
# Only costs measured from this generation's round timings can change; with the workers' costs (the prior) nothing a
# probe measures could make drafting pay, so there is no probe at all (CostPolicy.next_k, DraftingOff).
PROBE_RARELY = 64
# A probe that finds drafting still not paying doubles the wait before the next one, up to this many rounds: over a
# long generation on text the drafter does not follow (prose), probes cost a few rounds in all, not one in eight.
PROBE_MAX_GAP = 128
GATE_WINDOW = 8  # recent drafted rounds whose realised rate says whether drafting pays (drafting_pays)


class DraftPolicy(Protocol):
    """Chooses each round's draft length within a DraftLength's bounds."""

    def first_k(self) -> int:
        """The first round's draft length."""
        ...

    def next_k(self, k: int, rounds: Sequence[RoundRecord]) -> int:
        """The draft length after `rounds` (the last one drafted k' tokens, not necessarily k: the token budget and a
        degraded drafter shorten rounds)."""
        ...

    def bet_pays(self, k: int, rounds: Sequence[RoundRecord]) -> bool:
        """Pipelining: whether a round drafting k tokens should draft the next round during its verify."""
        ...

    def drafting_off(self) -> DraftingOff | None:
        """Before the first round: why this generation drafts nothing at all (the loop then leaves the drafter
        alone); None when it may draft."""
        ...


class FixedPolicy:
    """The same k every round (--draft-tokens K)."""

    def __init__(self, length: DraftLength) -> None:
        self.length = length

    def first_k(self) -> int:
        return self.length.initial

    def next_k(self, k: int, rounds: Sequence[RoundRecord]) -> int:
        return k

    def bet_pays(self, k: int, rounds: Sequence[RoundRecord]) -> bool:
        return True  # no costs known: the bet is always placed

    def drafting_off(self) -> DraftingOff | None:
        return None  # costs are not this policy's business


class HeuristicPolicy:
    """Hugging Face's: +2 after a round where every draft was accepted, -1 otherwise, within [minimum, maximum]."""

    def __init__(self, length: DraftLength) -> None:
        self.length = length

    def first_k(self) -> int:
        return self.length.initial

    def next_k(self, k: int, rounds: Sequence[RoundRecord]) -> int:
        last = rounds[-1] if rounds else None
        if last is None or not last.drafted:  # a round without drafts says nothing about k
            return max(k, self.length.minimum)
        if last.accepted == last.drafted:
            return min(self.length.maximum, k + 2)
        return max(self.length.minimum, k - 1)

    def bet_pays(self, k: int, rounds: Sequence[RoundRecord]) -> bool:
        return True  # no costs known: the bet is always placed

    def drafting_off(self) -> DraftingOff | None:
        return None  # costs are not this policy's business


class CostPolicy:
    """The k with the most expected tokens per second under the cost model; the heuristic until there is data."""

    def __init__(self, length: DraftLength) -> None:
        self.length = length
        self.fallback = HeuristicPolicy(length)

    def first_k(self) -> int:
        """With the workers' cost prior: `initial`, or the longer draft the prior finds best, where drafting pays at
        the prior's acceptance; else 0, and the first probe (next_k) measures this text's acceptance; 0 always where
        drafting is off (drafting_off). The prior's acceptance is a guess; whether drafting pays at this generation's
        acceptance is for its rounds to show (drafting_pays)."""
        prior = self._from_prior(())
        if prior is None:
            return self.length.initial
        best = prior.best_k(self.length.maximum)
        return max(self.length.initial, best) if best else 0

    def drafting_off(self) -> DraftingOff | CostsPending | None:
        """With the workers' costs, why no draft length can pay even at PLAUSIBLE_ACCEPTANCE; None where some k could
        pay. Without them: CostsPending while the workers are still measuring them, else None (workers that report
        no costs: round timings could show drafting pays)."""
        return self._drafting_off

    @cached_property
    def _drafting_off(self) -> DraftingOff | CostsPending | None:
        # The prior is fixed for the generation: decided once, not again in every round's next_k.
        prior = self._from_prior(())
        if prior is None:
            return CostsPending() if self.length.costs_pending else None
        return prior.drafting_off(self.length.maximum)

    def _from_prior(self, rounds: Sequence[RoundRecord]) -> CostEstimate | None:
        """The workers' measured costs, with this generation's acceptance (and, pipelined, the bet's hit rate and
        the verify's slowdown under a bet) once it has drafted. Round timings already hold the round trips and the
        bet's hiding, so only the prior models them."""
        if self.length.prior is None:
            return None
        acceptance = measured_acceptance(rounds)
        prior = replace(self.length.prior, pipelined=self.length.pipelined, bet_hit=measured_bet_hit(rounds),
                        bet_slowdown=measured_bet_slowdown(rounds, self.length.prior))
        if self.length.timed:  # on top of what earlier generations measured (the prior may already hold it)
            prior = replace(prior, drafting_slowdown=prior.drafting_slowdown
                            * measured_drafting_slowdown(rounds, prior, self.length.source))
        return prior if acceptance is None else replace(prior, acceptance=acceptance,
                                                        survival=measured_survival(rounds),
                                                        tail_acceptance=measured_tail_acceptance(rounds))

    def drafting_slowdown(self, rounds: Sequence[RoundRecord]) -> float | None:
        """The prior's drafting_slowdown as corrected by `rounds` (timed policies with a prior, once they have
        measured it); None otherwise."""
        own = [r for r in recent_drafted(rounds) if r.source == self.length.source]
        if not self.length.timed or len(own) < MIN_DRAFTED_ROUNDS:
            return None
        estimate = self._from_prior(rounds)
        return None if estimate is None else estimate.drafting_slowdown

    def bet_pays(self, k: int, rounds: Sequence[RoundRecord]) -> bool:
        """The cost model's answer with the workers' costs; without them (round timings only) always bet."""
        estimate = self._from_prior(rounds)
        return True if estimate is None else estimate.bet_pays(k)

    def next_k(self, k: int, rounds: Sequence[RoundRecord]) -> int:
        # The workers' measured costs when they reported them (with this generation's acceptance), else this
        # generation's round timings: with the prior, k depends on acceptance alone, so a seeded sampled run
        # repeats exactly (round timings vary from run to run; the prior does not).
        estimate = self._from_prior(rounds) or estimate_costs(rounds)
        if estimate is None:
            return self.fallback.next_k(k, rounds)
        minimum, maximum = self.length.minimum, self.length.maximum
        best = estimate.best_k(maximum)
        could_pay = estimate.could_pay(maximum)
        if self.length.prior is not None and self.drafting_off() is not None:
            return 0  # the workers' costs rule drafting out for the whole generation: no probe either
        if could_pay and drafting_pays(rounds, estimate, maximum):
            # Follow the run as the heuristic does (+2 after a full acceptance, -1 after a rejection), or, once a few
            # rounds have measured acceptance, draft what the model finds best where that is longer (cheap drafts:
            # an n-gram drafter, a hidden pipelined bet).
            measured = len(recent_drafted(rounds)) >= MIN_DRAFTED_ROUNDS
            return max(best if measured else 0, self.fallback.next_k(k, rounds))
        if best >= minimum:
            return best
        if self.length.prior is not None and not estimate.could_pay(maximum, PLAUSIBLE_ACCEPTANCE):
            # The workers' costs (timed: as this generation's rounds corrected them) hold for the rest of it, and
            # with them no k pays even at PLAUSIBLE_ACCEPTANCE: a probe would cost a round and find nothing to win.
            return 0
        # Drafting does not pay now; keep probing so a change (say, code after prose) is noticed, less often after
        # each probe that found nothing.
        every = PROBE_EVERY if could_pay else PROBE_RARELY
        gap = max(min(every * 2 ** failed_probes(rounds), PROBE_MAX_GAP), every)
        probing = len(rounds) >= gap and all(r.drafted == 0 for r in rounds[-(gap - 1):])
        return minimum if probing else 0


def drafting_pays(rounds: Sequence[RoundRecord], costs: CostEstimate, maximum: int = 16) -> bool:
    """Whether to keep drafting after the last round. After a fully accepted round, yes where some k up to `maximum`
    pays at the run acceptance (run_acceptance: the drafter is following the text, and bursty acceptance makes the
    rest of such a run longer than any average predicts; the run lengths of the real pair on code: 0, 20, 0, 9, 7, 0,
    0, 14, 8 tokens), but not where even a run cannot pay for its drafts (a slow drafter, a steep verify). After a
    rejection, yes while the recent drafted rounds' realised rate (the tokens they committed over what `costs` price
    them at) is at least target-only's; and while too few rounds have drafted to tell. After a round without drafts,
    no (the caller probes)."""
    last = rounds[-1] if rounds else None
    if last is None or not last.drafted:
        return False
    if last.accepted == last.drafted:
        return costs.could_pay(maximum, run_acceptance(rounds))
    drafted = recent_drafted(rounds)[-GATE_WINDOW:]
    if len(drafted) < MIN_DRAFTED_ROUNDS:
        return True
    realised = sum(r.accepted + 1 for r in drafted) / max(sum(costs.round_s(r.drafted) for r in drafted), 1e-9)
    return realised >= costs.tokens_per_s(0)  # target-only's rate


# The adaptive policies by the name --draft-policy takes; each is built from the DraftLength it works within.
POLICIES: dict[str, Callable[[DraftLength], DraftPolicy]] = {"heuristic": HeuristicPolicy, "cost": CostPolicy}


@dataclass(frozen=True)
class DraftLength:
    """How many tokens to draft per round: fixed, or adaptive by `policy` (a name in POLICIES) within
    [minimum, maximum]."""

    initial: int = 4
    adaptive: bool = True
    minimum: int = 1
    maximum: int = 16
    policy: str = DEFAULT_POLICY
    # cost policy: the workers' own cost measurements (Info), used until this generation has measured enough rounds
    prior: CostEstimate | None = None
    pipelined: bool = False  # the loop drafts ahead during each verify: the cost policy models the bet
    # cost policy: correct the prior by this generation's round timings (measured_drafting_slowdown). Only where the
    # output does not depend on k (greedy): a seeded sampled generation repeats exactly only if k never depends on
    # timing.
    timed: bool = False
    # cost policy without a prior because the workers are still measuring their costs: draft nothing (CostsPending)
    costs_pending: bool = False
    # The draft source the prior's costs are (RoundRecord.source): only its rounds correct the prior (timed) and say
    # how much slower than its costs drafting ran. Hybrid drafting: "suffix" (the draft model gates itself).
    source: str = ""

    def __post_init__(self) -> None:
        if self.initial < 0 or self.minimum < 1 or self.maximum < self.minimum:
            raise ValueError(f"invalid draft length bounds: {self}")
        if self.adaptive and not self.minimum <= self.initial <= self.maximum:
            raise ValueError(f"initial draft length {self.initial} outside [{self.minimum}, {self.maximum}]")
        if self.policy not in POLICIES:
            raise ValueError(f"draft policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")

    @classmethod
    def fixed(cls, k: int) -> "DraftLength":
        return cls(initial=k, adaptive=False, minimum=1, maximum=max(k, 1))

    @cached_property
    def rule(self) -> DraftPolicy:
        """The policy object deciding k within these bounds."""
        return POLICIES[self.policy](self) if self.adaptive else FixedPolicy(self)

    def first(self) -> int:
        """The first round's draft length."""
        return self.rule.first_k()

    def next(self, k: int, rounds: Sequence[RoundRecord]) -> int:
        """The draft length after `rounds` (see DraftPolicy.next_k)."""
        return self.rule.next_k(k, rounds)

    def after_full_acceptance(self, k: int, rounds: Sequence[RoundRecord], draft_s: float) -> int:
        """The draft length the next round would get if this round's k drafts (drafted in draft_s) were all
        accepted: what a pipelined bet drafts ahead, besides its guess of the target's own token. The round's verify
        time is not known yet: the previous round's stands in (only the prior-less cost policy reads it)."""
        verify_s = rounds[-1].verify_s if rounds else 0.0
        return self.next(k, [*rounds, RoundRecord(k, k, draft_s, verify_s, source=self.source)])

    def rounds_without_drafts(self, rounds: Sequence[RoundRecord], limit: int) -> int:
        """The next round drafts nothing (the policy chose k = 0 after `rounds`): how many rounds in a row, it
        included and up to `limit` (at most PROBE_MAX_GAP), the policy would keep drafting nothing, as it would
        judge them one by one. What the loop decodes as one stream. Their timings are not known yet: the last round
        without drafts stands in."""
        zero = next((r for r in reversed(rounds) if not r.drafted), rounds[-1] if rounds else None)
        stand_in = RoundRecord(0, 0, 0.0, zero.verify_s if zero is not None else 0.0)
        simulated, count = [*rounds, stand_in], 1
        while count < min(limit, PROBE_MAX_GAP) and self.next(0, simulated) == 0:
            simulated.append(stand_in)
            count += 1
        return min(count, limit)

    def bet_pays(self, k: int, rounds: Sequence[RoundRecord]) -> bool:
        """Pipelining: whether a round drafting k tokens after `rounds` should bet (see DraftPolicy.bet_pays)."""
        return self.rule.bet_pays(k, rounds)

    def drafting_off(self) -> DraftingOff | CostsPending | None:
        """Why this generation drafts nothing at all, decided before its first round (see DraftPolicy.drafting_off)."""
        return self.rule.drafting_off()

    def measured_slowdown(self, rounds: Sequence[RoundRecord]) -> float | None:
        """How much slower than the workers' costs drafted rounds ran, by this generation's rounds (the cost policy,
        timed, with a prior); None where it did not measure it. The coordinator carries it to its next generations."""
        measure = getattr(self.rule, "drafting_slowdown", None)
        return measure(rounds) if measure is not None else None

    def describe(self) -> str:
        """The policy in a few words, for the stats: "fixed k = 4", "adaptive k (cost policy)"."""
        return f"adaptive k ({self.policy} policy)" if self.adaptive else f"fixed k = {self.initial}"
