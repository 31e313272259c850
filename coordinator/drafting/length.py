"""DraftLength: the bounds of a generation's draft length and the policy that decides it within them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from coordinator.drafting.costs import CostEstimate, CostsPending, DraftingOff
from coordinator.drafting.policies import DEFAULT_POLICY, POLICIES, PROBE_MAX_GAP, DraftPolicy, FixedPolicy
from coordinator.drafting.rounds import RoundRecord


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
