"""How many tokens to draft next round, from what the previous rounds measured.

Every policy answers two questions (the DraftPolicy protocol): the first round's k, and the next round's k after the
rounds so far. `POLICIES` names the adaptive ones a user may choose:
- "heuristic" (Hugging Face's): +2 after a round where every draft was accepted, -1 otherwise.
- "cost": pick the k that maximises expected tokens per second from the speculative decoding cost model,
  E(k) / (k*c + v(k)) with E(k) = (1 - a^(k+1)) / (1 - a) (Leviathan et al.), where a is the per-token acceptance rate,
  c the drafter's seconds per token and v(k) the verify round's seconds for k drafts, all measured on this
  generation's recent rounds. Unlike the heuristic it knows what a draft token and a wider verify pass COST here, so
  it drafts less where drafting does not pay (prose, slow drafter, a verifier whose cost grows with k) and can fall
  back to k = 0 (plain target decoding), probing with a small draft now and then to notice when drafting pays again.
A fixed k (`DraftLength.fixed`) is the third, non-adaptive policy.

Policies are pure functions of the round history, so they are unit-testable and keep no state of their own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Protocol

DEFAULT_POLICY = "cost"
WINDOW = 32  # recent rounds the cost model looks at: the text changes character within a generation
PROBE_EVERY = 8  # with k = 0 chosen, one round in this many drafts `minimum` tokens to keep measuring acceptance
# With k = 0 chosen because drafting could not pay even if every draft were accepted (a slow drafter, a verifier whose
# cost grows with every draft), acceptance is not worth measuring: probe only this rarely, to notice changed costs.
PROBE_RARELY = 64
PRIOR_ACCEPTANCE = 0.7  # per-token acceptance assumed before any round has measured it
MIN_DRAFTED_ROUNDS = 3  # below this the cost model has too little data and the heuristic decides


@dataclass(frozen=True)
class RoundRecord:
    """What one round of the loop measured: the input of every draft-length policy."""

    drafted: int
    accepted: int
    draft_s: float
    verify_s: float


def expected_tokens_per_round(acceptance: float, k: float) -> float:
    """E = (1 - a^(k+1)) / (1 - a): tokens a round with k drafts commits on average (accepted prefix + the target's
    own token) when each draft is accepted with probability a, independently (Leviathan et al.)."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1.0)) / (1.0 - acceptance)


@dataclass(frozen=True)
class CostEstimate:
    acceptance: float  # per draft token
    draft_s_per_token: float
    verify_s_base: float  # v(k) = verify_s_base + verify_s_per_token * k
    verify_s_per_token: float

    def expected_tokens(self, k: int) -> float:
        """Tokens a round with k drafts commits on average: accepted prefix + the target's own token."""
        return expected_tokens_per_round(self.acceptance, k)

    def tokens_per_s(self, k: int) -> float:
        seconds = k * self.draft_s_per_token + self.verify_s_base + self.verify_s_per_token * k
        return self.expected_tokens(k) / max(seconds, 1e-9)

    def best_k(self, maximum: int) -> int:
        return max(range(maximum + 1), key=self.tokens_per_s)

    def could_pay(self, maximum: int) -> bool:
        """Whether some k >= 1 would do at least as well as k = 0 if every draft were accepted."""
        certain = replace(self, acceptance=1.0)
        return max(map(certain.tokens_per_s, range(1, maximum + 1)), default=0.0) >= certain.tokens_per_s(0)


def recent_drafted(rounds: Sequence[RoundRecord]) -> list[RoundRecord]:
    """The last WINDOW rounds that carried drafts (round 0, the prefill, left out): what is known about drafting,
    however long ago the policy last drafted."""
    return [r for r in rounds[1:] if r.drafted][-WINDOW:]


def measured_acceptance(rounds: Sequence[RoundRecord]) -> float | None:
    """Maximum-likelihood per-token acceptance under the geometric model (each accepted draft token a success, each
    round that stopped before its last draft one failure), over recent drafted rounds; None without any."""
    drafted = recent_drafted(rounds)
    accepted = sum(r.accepted for r in drafted)
    stopped_early = sum(r.accepted < r.drafted for r in drafted)
    return accepted / (accepted + stopped_early) if accepted + stopped_early else None


def estimate_costs(rounds: Sequence[RoundRecord]) -> CostEstimate | None:
    """Fit the cost model to recent rounds; None while there is too little data (too few drafted rounds, or verify
    times seen at only one draft length so v(k)'s slope is unknown)."""
    drafted = recent_drafted(rounds)
    # Verify times: the recent rounds and the last drafted ones (round 0 carries the prompt's prefill: left out).
    recent = list({id(r): r for r in [*drafted, *list(rounds[1:])[-WINDOW:]]}.values())
    if len(drafted) < MIN_DRAFTED_ROUNDS or len({r.drafted for r in recent}) < 2:
        return None
    acceptance = measured_acceptance(rounds) or 0.0
    draft_s_per_token = sum(r.draft_s for r in drafted) / sum(r.drafted for r in drafted)
    # Least squares line through (k, verify seconds).
    n = len(recent)
    mean_k = sum(r.drafted for r in recent) / n
    mean_v = sum(r.verify_s for r in recent) / n
    var_k = sum((r.drafted - mean_k) ** 2 for r in recent)
    slope = sum((r.drafted - mean_k) * (r.verify_s - mean_v) for r in recent) / var_k
    slope = max(slope, 0.0)  # a wider pass never costs less; noise must not make drafting look free
    base = max(mean_v - slope * mean_k, 1e-6)
    return CostEstimate(acceptance, draft_s_per_token, base, slope)


class DraftPolicy(Protocol):
    """Chooses each round's draft length within a DraftLength's bounds."""

    def first_k(self) -> int:
        """The first round's draft length."""
        ...

    def next_k(self, k: int, rounds: Sequence[RoundRecord]) -> int:
        """The draft length after `rounds` (the last one drafted k' tokens, not necessarily k: the token budget and a
        degraded drafter shorten rounds)."""
        ...


class FixedPolicy:
    """The same k every round (--draft-tokens K)."""

    def __init__(self, length: DraftLength) -> None:
        self.length = length

    def first_k(self) -> int:
        return self.length.initial

    def next_k(self, k: int, rounds: Sequence[RoundRecord]) -> int:
        return k


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


class CostPolicy:
    """The k with the most expected tokens per second under the cost model; the heuristic until there is data."""

    def __init__(self, length: DraftLength) -> None:
        self.length = length
        self.fallback = HeuristicPolicy(length)

    def first_k(self) -> int:
        """With the workers' cost prior, what the prior says pays (possibly 0); otherwise `initial`."""
        if self.length.prior is None:
            return self.length.initial
        best = self.length.prior.best_k(self.length.maximum)
        return best if best >= self.length.minimum else 0

    def _from_prior(self, rounds: Sequence[RoundRecord]) -> CostEstimate | None:
        """The workers' measured costs, with this generation's acceptance once it has drafted."""
        if self.length.prior is None:
            return None
        acceptance = measured_acceptance(rounds)
        return self.length.prior if acceptance is None else replace(self.length.prior, acceptance=acceptance)

    def next_k(self, k: int, rounds: Sequence[RoundRecord]) -> int:
        # The workers' measured costs when they reported them (with this generation's acceptance), else this
        # generation's round timings: with the prior, k depends on acceptance alone, so a seeded sampled run
        # repeats exactly (round timings vary from run to run; the prior does not).
        estimate = self._from_prior(rounds) or estimate_costs(rounds)
        if estimate is None:
            return self.fallback.next_k(k, rounds)
        minimum, maximum = self.length.minimum, self.length.maximum
        best = estimate.best_k(maximum)
        if best >= minimum:
            return best
        # Drafting does not pay now; keep probing so a change (say, code after prose) is noticed.
        every = PROBE_EVERY if estimate.could_pay(maximum) else PROBE_RARELY
        probing = len(rounds) >= every and all(r.drafted == 0 for r in rounds[-(every - 1):])
        return minimum if probing else 0


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
