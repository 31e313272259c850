"""How many tokens to draft next round, from what the previous rounds measured.

Two adaptive policies:
- "heuristic" (Hugging Face's): +2 after a round where every draft was accepted, -1 otherwise.
- "cost": pick the k that maximises expected tokens per second from the speculative decoding cost model,
  E(k) / (k*c + v(k)) with E(k) = (1 - a^(k+1)) / (1 - a) (Leviathan et al.), where a is the per-token acceptance rate,
  c the drafter's seconds per token and v(k) the verify round's seconds for k drafts, all measured on this
  generation's recent rounds. Unlike the heuristic it knows what a draft token and a wider verify pass COST here, so
  it drafts less where drafting does not pay (prose, slow drafter, a verifier whose cost grows with k) and can fall
  back to k = 0 (plain target decoding), probing with a small draft now and then to notice when drafting pays again.

Both are pure functions of the round history, so they are unit-testable and keep no state of their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

POLICIES = ("heuristic", "cost")
DEFAULT_POLICY = "heuristic"
WINDOW = 32  # recent rounds the cost model looks at: the text changes character within a generation
PROBE_EVERY = 8  # with k = 0 chosen, one round in this many drafts `minimum` tokens to keep measuring acceptance
MIN_DRAFTED_ROUNDS = 3  # below this the cost model has too little data and the heuristic decides


class Round(Protocol):
    drafted: int
    accepted: int
    draft_s: float
    verify_s: float


@dataclass(frozen=True)
class CostEstimate:
    acceptance: float  # per draft token
    draft_s_per_token: float
    verify_s_base: float  # v(k) = verify_s_base + verify_s_per_token * k
    verify_s_per_token: float

    def expected_tokens(self, k: int) -> float:
        """Tokens a round with k drafts commits on average: accepted prefix + the target's own token."""
        a = min(self.acceptance, 0.999999)
        return (1 - a ** (k + 1)) / (1 - a)

    def tokens_per_s(self, k: int) -> float:
        seconds = k * self.draft_s_per_token + self.verify_s_base + self.verify_s_per_token * k
        return self.expected_tokens(k) / max(seconds, 1e-9)

    def best_k(self, maximum: int) -> int:
        return max(range(maximum + 1), key=self.tokens_per_s)


def estimate_costs(rounds: Sequence[Round]) -> CostEstimate | None:
    """Fit the cost model to recent rounds; None while there is too little data (too few drafted rounds, or verify
    times seen at only one draft length so v(k)'s slope is unknown)."""
    recent = list(rounds[1:])[-WINDOW:]  # round 0 carries the prompt's prefill: not a typical round
    drafted = [r for r in recent if r.drafted]
    if len(drafted) < MIN_DRAFTED_ROUNDS or len({r.drafted for r in recent}) < 2:
        return None
    accepted = sum(r.accepted for r in drafted)
    # Maximum-likelihood per-token acceptance under the geometric model: each accepted draft token is a success,
    # each round that stopped before its last draft one failure.
    stopped_early = sum(r.accepted < r.drafted for r in drafted)
    acceptance = accepted / (accepted + stopped_early) if accepted + stopped_early else 0.0
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


@dataclass(frozen=True)
class DraftLength:
    """How many tokens to draft per round: fixed, or adaptive by `policy` within [minimum, maximum]."""

    initial: int = 4
    adaptive: bool = True
    minimum: int = 1
    maximum: int = 16
    policy: str = DEFAULT_POLICY

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

    def next(self, k: int, rounds: Sequence[Round]) -> int:
        """The draft length after `rounds` (the last one drafted k' tokens, not necessarily k: the token budget and a
        degraded drafter shorten rounds)."""
        if not self.adaptive:
            return k
        if self.policy == "cost":
            estimate = estimate_costs(rounds)
            if estimate is not None:
                best = estimate.best_k(self.maximum)
                if best >= self.minimum:
                    return best
                # Drafting does not pay now; keep probing so a change (say, code after prose) is noticed.
                probing = all(r.drafted == 0 for r in rounds[-(PROBE_EVERY - 1):])
                return self.minimum if probing else 0
        last = rounds[-1] if rounds else None
        if last is None or not last.drafted:  # a round without drafts says nothing about k
            return max(k, self.minimum)
        return min(self.maximum, k + 2) if last.accepted == last.drafted else max(self.minimum, k - 1)
