"""The speculative decoding cost model: what a round with k drafts commits and costs, given the workers' costs.

A round with k drafts commits E(k) tokens and costs k*c + v(k): c the drafter's seconds per token, v(k) the verify's
seconds for k drafts (the verifier's measured curve, see CostEstimate.verify_curve), E(k) from the acceptance.

Two more costs enter the model when the workers report theirs (the prior): the network round trip of each RPC (a
round with drafts makes a Propose and a Verify call, a round without drafts only the Verify), and, with pipelining,
the part of the drafting the pipelined bet hides. While the verifier checks round r's k drafts, the drafter drafts
k + 1 more (the bet); when every draft is accepted and the bet's first token is the target's own, round r+1 starts
without drafting, so a round costs max(verify, bet) plus the ordinary draft only when the bet lost:
T(k) = max(rtt_v + v(k), rtt_d + (k+1)*c) + (1 - a^k * h) * (rtt_d + k*c), h the bet's measured hit rate on its
first token (the acceptance until measured). A bet that outlasts the verify and rarely wins costs more than it saves
(the next draft waits for it): the cost policy then tells the loop not to bet (`bet_pays`), and the round costs what
an unpipelined one does. With a drafter on its own host the bet is free and long drafts pay more. Where drafter and
verifier share hardware (cores, memory bandwidth), a verify runs slower while the bet is drafted; the workers' idle
costs cannot show that, so the policy measures it: how much slower this generation's verifies ran with a bet than
without (against the workers' costs), after MIN_BET_ROUNDS bets, and counts the verify that much longer when betting.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, replace
from functools import lru_cache

PRIOR_ACCEPTANCE = 0.7  # per-token acceptance assumed before any round has measured it
# The per-token acceptance a draft model keeps up, at best, over a stretch of text (quoted input, boilerplate code).
# Where the workers' costs say that even this acceptance cannot pay, drafting is off for the generation: full
# acceptance is never seen for long, and a gain that needs it is smaller than what finding it out costs.
PLAUSIBLE_ACCEPTANCE = 0.9


def expected_tokens_per_round(acceptance: float, k: float) -> float:
    """E = (1 - a^(k+1)) / (1 - a): tokens a round with k drafts commits on average (accepted prefix + the target's
    own token) when each draft is accepted with probability a, independently (Leviathan et al.)."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1.0)) / (1.0 - acceptance)


# The cost model's two searches over k, remembered per estimate (a frozen dataclass, so equal estimates hash alike):
# the loop asks them again for every round it simulates (DraftLength.rounds_without_drafts: up to PROBE_MAX_GAP
# rounds before a stretch's stream opens), mostly of the same estimate, and each search prices every k (0.3 ms).
@lru_cache(maxsize=256)
def _best_k(costs: "CostEstimate", maximum: int) -> int:
    return max(range(maximum + 1), key=costs.tokens_per_s)


@lru_cache(maxsize=256)
def _could_pay(costs: "CostEstimate", maximum: int, acceptance: float) -> bool:
    at = costs.at_acceptance(acceptance)
    return max(map(at.tokens_per_s, range(1, maximum + 1)), default=0.0) >= at.tokens_per_s(0)


@dataclass(frozen=True)
class CostEstimate:
    acceptance: float  # per draft token
    draft_s_per_token: float
    verify_s_base: float  # v(k) = verify_s_base + verify_s_per_token * k, unless verify_curve is given
    verify_s_per_token: float
    draft_round_trip_s: float = 0.0  # network and RPC time of one Propose call, apart from drafting
    verify_round_trip_s: float = 0.0  # the same for one Verify call
    pipelined: bool = False  # the next round is drafted during this round's verify (the bet)
    bet_hit: float | None = None  # P(the bet's first token is the target's own | every draft accepted); None: a
    bet_slowdown: float = 1.0  # how much longer a verify takes while the bet is drafted (shared hardware: > 1)
    # Measured P(the first j drafts are all accepted) for j = 1, 2, ... (Kaplan-Meier); empty: geometric in acceptance
    survival: tuple[float, ...] = ()
    tail_acceptance: float | None = None  # per-position acceptance past the measured survival; None: acceptance
    # Measured (drafts, verify seconds) points, drafts ascending from 0: v(k) by linear interpolation between them and
    # the last segment's slope past them. A pass over a few tokens is far from linear in their number on CPUs (one
    # row runs a matrix-vector kernel, two or more a matrix-matrix one: 1.5B float32 here, 0.47 s for 0 drafts,
    # 0.78 s for 1, 0.92 s for 4, 1.32 s for 16); a line through 0 and 4 drafts would price 16 at 2.3 s.
    verify_curve: tuple[tuple[int, float], ...] = ()
    # A generation that never drafts is one Decode stream (coordinator/loop.py): a token costs v(0), no round trip.
    target_streams: bool = False
    # How much longer a round with drafts takes than these costs say (measured_drafting_slowdown): drafter and
    # verifier on shared cores, contexts longer than the workers' warm-up probes.
    drafting_slowdown: float = 1.0
    # Seconds a streamed token took where a generation measured it (the hybrid's stretches without drafts); None: v(0)
    streamed_token_s: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.acceptance <= 1.0 or (self.bet_hit is not None and not 0.0 <= self.bet_hit <= 1.0):
            raise ValueError(f"acceptance and bet_hit must be probabilities: {self}")
        if min(self.draft_s_per_token, self.verify_s_base, self.verify_s_per_token, self.draft_round_trip_s,
               self.verify_round_trip_s) < 0:
            raise ValueError(f"costs must be >= 0: {self}")
        if self.bet_slowdown < 1.0:
            raise ValueError(f"bet_slowdown must be >= 1: {self}")
        if not self.drafting_slowdown > 0:
            raise ValueError(f"drafting_slowdown must be > 0: {self}")
        if self.streamed_token_s is not None and not self.streamed_token_s > 0:
            raise ValueError(f"streamed_token_s must be > 0: {self}")
        if self.tail_acceptance is not None and not 0.0 <= self.tail_acceptance <= 1.0:
            raise ValueError(f"tail_acceptance must be a probability: {self}")
        if any(not 0.0 <= p <= 1.0 for p in self.survival) or list(self.survival) != sorted(self.survival,
                                                                                            reverse=True):
            raise ValueError(f"survival must be non-increasing probabilities: {self}")
        drafts = [k for k, _ in self.verify_curve]
        if self.verify_curve and (drafts[0] != 0 or drafts != sorted(set(drafts))
                                  or min(s for _, s in self.verify_curve) < 0):
            raise ValueError(f"verify_curve must be (drafts, seconds >= 0) points with drafts ascending from 0: {self}")

    def verify_s(self, k: int) -> float:
        """Seconds of the verifier's work for k drafts (without the round trip)."""
        curve = self.verify_curve
        if not curve:
            return self.verify_s_base + self.verify_s_per_token * k
        if len(curve) == 1:
            return curve[0][1]
        # The segment ending at the first point at or past k; past the last point, the last segment.
        end = min(max(bisect_left([drafts for drafts, _ in curve], k), 1), len(curve) - 1)
        (k0, s0), (k1, s1) = curve[end - 1], curve[end]
        return max(s0 + (s1 - s0) * (k - k0) / (k1 - k0), 0.0)

    def reach(self, j: int) -> float:
        """P(the first j drafts are all accepted)."""
        if not self.survival:
            return self.acceptance ** j
        if j <= len(self.survival):
            return self.survival[j - 1] if j else 1.0
        tail = self.acceptance if self.tail_acceptance is None else self.tail_acceptance
        return self.survival[-1] * tail ** (j - len(self.survival))

    def expected_tokens(self, k: int) -> float:
        """Tokens a round with k drafts commits on average: accepted prefix + the target's own token."""
        if not self.survival:
            return expected_tokens_per_round(self.acceptance, k)
        return 1.0 + sum(self.reach(j) for j in range(1, k + 1))

    def _verify_and_draft_s(self, k: int) -> tuple[float, float]:
        return (self.verify_round_trip_s + self.verify_s(k),
                self.draft_round_trip_s + k * self.draft_s_per_token if k else 0.0)

    def _betting_round_s(self, k: int) -> float:
        verify, draft = self._verify_and_draft_s(k)
        bet = self.draft_round_trip_s + (k + 1) * self.draft_s_per_token
        hit = self.acceptance if self.bet_hit is None else self.bet_hit
        return max(verify * self.bet_slowdown, bet) + (1.0 - self.reach(k) * hit) * draft

    def bet_pays(self, k: int) -> bool:
        """Whether drafting the next round during this round's verify saves time on average (pipelined only)."""
        return self.pipelined and k > 0 and self._betting_round_s(k) < sum(self._verify_and_draft_s(k))

    def round_s(self, k: int) -> float:
        """Expected seconds of a round with k drafts (see the module's docstring for the pipelined case)."""
        seconds = self._betting_round_s(k) if self.bet_pays(k) else sum(self._verify_and_draft_s(k))
        return seconds * self.drafting_slowdown if k else seconds

    def tokens_per_s(self, k: int) -> float:
        """Expected tokens per second drafting k per round; k = 0 is target-only decoding (target_only_s)."""
        return self.expected_tokens(k) / max(self.round_s(k) if k else self.target_only_s(), 1e-9)

    def best_k(self, maximum: int) -> int:
        return _best_k(self, maximum)

    def with_draft_overhead(self, overhead_s: float) -> CostEstimate:
        """The same costs with every round that drafts taking `overhead_s` seconds more (its Propose call and what
        comes with it): what a draft model's measured overhead makes of its costs."""
        return replace(self, draft_round_trip_s=self.draft_round_trip_s + overhead_s)

    def at_acceptance(self, acceptance: float) -> CostEstimate:
        """The same costs with every draft accepted independently with probability `acceptance` (geometric E(k))."""
        return replace(self, acceptance=acceptance, survival=(), tail_acceptance=None)

    def could_pay(self, maximum: int, acceptance: float = 1.0) -> bool:
        """Whether some k >= 1 would do at least as well as target-only decoding at this per-token acceptance
        (default: if every draft were accepted)."""
        return _could_pay(self, maximum, acceptance)

    def target_only_s(self) -> float:
        """Seconds per token without drafts: streamed (the loop streams every stretch without drafts), v(0) or what
        the streamed tokens measured; else a round with k = 0, its round trip included."""
        if not self.target_streams:
            return self.round_s(0)
        return self.verify_s(0) if self.streamed_token_s is None else self.streamed_token_s

    def drafting_off(self, maximum: int) -> DraftingOff | None:
        """Why no draft length up to `maximum` pays even at PLAUSIBLE_ACCEPTANCE, with the numbers: for every k >= 1,
        E(k) / T(k) < 1 / T0 (T a round's seconds, round trips included; T0 a target-only token's, target_only_s);
        None where some k could pay."""
        step = self.target_only_s()
        if self.could_pay(maximum, PLAUSIBLE_ACCEPTANCE):
            return None
        certain, plausible = self.at_acceptance(1.0), self.at_acceptance(PLAUSIBLE_ACCEPTANCE)
        best = max(range(1, maximum + 1), key=certain.tokens_per_s)
        best_plausible = max(range(1, maximum + 1), key=plausible.tokens_per_s)
        shown = sorted({k for k in (1, 2, 4, 8, 16, maximum) if k <= maximum})
        return DraftingOff(target_step_s=step, draft_s_per_token=self.draft_s_per_token,
                           draft_round_trip_s=self.draft_round_trip_s,
                           verify_s=tuple((k, self.verify_round_trip_s + self.verify_s(k)) for k in shown),
                           best_k=best, best_speedup=certain.tokens_per_s(best) * step,
                           plausible_speedup=plausible.tokens_per_s(best_plausible) * step,
                           drafting_slowdown=self.drafting_slowdown)


@dataclass(frozen=True)
class DraftingOff:
    """The cost policy's decision, before the first round, that a generation drafts nothing: by the workers' measured
    costs no draft length pays even if every draft is accepted. Seconds here; str() says it in target steps (a
    target-only round, round trip included), as the summary line and the stats show it."""

    target_step_s: float  # a token of target-only decoding: v(0), plus the verify round trip unless streamed
    draft_s_per_token: float  # c
    draft_round_trip_s: float  # a Propose call's network time, paid by every round that drafts
    verify_s: tuple[tuple[int, float], ...]  # (k, the verify round trip + v(k)) for a few k
    best_k: int  # the draft length that would come closest
    best_speedup: float  # its tokens/s over target-only's, with every draft accepted
    plausible_speedup: float = 0.0  # the best k's tokens/s over target-only's at PLAUSIBLE_ACCEPTANCE (< 1)
    drafting_slowdown: float = 1.0  # drafted rounds measured this much slower than the workers' costs say

    def __str__(self) -> str:
        step = max(self.target_step_s, 1e-12)
        verify = ", ".join(f"v({k})={s / step:.2f}" for k, s in self.verify_s)
        propose = (f", Propose round trip {self.draft_round_trip_s / step:.2f}" if self.draft_round_trip_s else "")
        return (f"drafting off: no draft length pays (c={self.draft_s_per_token / step:.2f} of a target step, "
                f"{verify}{propose}; best possible {self.best_speedup:.2f}x target-only, at k={self.best_k} with every "
                f"draft accepted, {self.plausible_speedup:.2f}x at {PLAUSIBLE_ACCEPTANCE:.0%} acceptance"
                + (f"; drafted rounds measured {self.drafting_slowdown:.2f}x slower than the workers' costs"
                   if self.drafting_slowdown != 1.0 else "") + ")")

    def details(self) -> str:
        """The same in seconds, with the bound, for the log."""
        verify = ", ".join(f"v({k})={s:.4g} s" for k, s in self.verify_s)
        return (f"c={self.draft_s_per_token:.4g} s per draft token, Propose round trip "
                f"{self.draft_round_trip_s:.4g} s, target-only {self.target_step_s:.4g} s per token, {verify} "
                f"(verify round trips included); bound: the best (k+1)/(k*c + v(k) + round trips) over k >= 1, at "
                f"k={self.best_k}, is {self.best_speedup:.3f} x target-only's rate; the best "
                f"E(k)/(k*c + v(k) + round trips) at {PLAUSIBLE_ACCEPTANCE:.0%} acceptance is "
                f"{self.plausible_speedup:.3f} x target-only's rate")


class CostsPending:
    """The cost policy's decision that a generation drafts nothing because it starts before the workers have measured
    their costs (they do once SERVING, unless cached): whether drafting can pay here is unknown, and drafting blind
    can cost more than it wins (0.8x target-only on 2 shared cores). Later generations start from the costs."""

    def __str__(self) -> str:
        return "drafting off: the workers have not measured their costs yet (the cost policy does not draft blind)"

    def details(self) -> str:
        return ("they measure them in the background after SERVING, unless cached; the coordinator reads them again "
                "before its next generations")
