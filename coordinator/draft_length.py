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

Acceptance is bursty: where the draft model follows the text (code, quoted input) whole rounds are accepted, where
it does not the first draft already fails. Per token, E(k) = (1 - a^(k+1)) / (1 - a) (Leviathan et al.), a the
per-token acceptance. That geometric E(k), fitted to such rounds, underestimates long drafts
(the transformers bench: 3.6 tokens per round predicted at k = 7, 6.2 measured), and a policy that trusts it drafts 2
where 7 pays. So once the generation has drafted, E(k) = 1 + S(1) + ... + S(k) with S(j), the probability that the
first j drafts are all accepted, measured by the Kaplan-Meier estimator over the recent rounds (a round that
accepted all its k drafts says only that its run reached k: right-censored). Past the positions enough rounds
reached, S decays at the per-position acceptance measured beyond the first draft (with one pseudo-failure, so that
a few fully accepted rounds never promise endless runs).

Policies are pure functions of the round history, so they are unit-testable and keep no state of their own.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache
from typing import Protocol

DEFAULT_POLICY = "cost"
WINDOW = 32  # recent rounds the cost model looks at: the text changes character within a generation
PROBE_EVERY = 8  # with k = 0 chosen, one round in this many drafts `minimum` tokens to keep measuring acceptance
# With k = 0 chosen because drafting could not pay even if every draft were accepted (a slow drafter, a verifier whose
# cost grows with every draft), acceptance is not worth measuring: probe only this rarely, to notice changed costs.
# Only costs measured from this generation's round timings can change; with the workers' costs (the prior) nothing a
# probe measures could make drafting pay, so there is no probe at all (CostPolicy.next_k, DraftingOff).
PROBE_RARELY = 64
# A probe that finds drafting still not paying doubles the wait before the next one, up to this many rounds: over a
# long generation on text the drafter does not follow (prose), probes cost a few rounds in all, not one in eight.
PROBE_MAX_GAP = 128
PRIOR_ACCEPTANCE = 0.7  # per-token acceptance assumed before any round has measured it
# The per-token acceptance a draft model keeps up, at best, over a stretch of text (quoted input, boilerplate code).
# Where the workers' costs say that even this acceptance cannot pay, drafting is off for the generation: full
# acceptance is never seen for long, and a gain that needs it is smaller than what finding it out costs.
PLAUSIBLE_ACCEPTANCE = 0.9
# Run acceptance (after a fully accepted round) is estimated with this many pseudo-tokens at PLAUSIBLE_ACCEPTANCE.
RUN_PRIOR_TOKENS = 4
MIN_DRAFTED_ROUNDS = 3  # below this the cost model has too little data and the heuristic decides
MIN_BET_ROUNDS = 3  # pipelined rounds measured before their verifies' slowdown counts
GATE_WINDOW = 8  # recent drafted rounds whose realised rate says whether drafting pays (drafting_pays)
MIN_AT_RISK = 4  # rounds that must have reached a draft position before its acceptance is estimated on its own


@dataclass(frozen=True)
class RoundRecord:
    """What one round of the loop measured: the input of every draft-length policy."""

    drafted: int
    accepted: int
    draft_s: float
    verify_s: float
    bet_won: bool | None = None  # pipelining: whether the next round's draft came from this round's bet; None: no bet


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

    def at_acceptance(self, acceptance: float) -> CostEstimate:
        """The same costs with every draft accepted independently with probability `acceptance` (geometric E(k))."""
        return replace(self, acceptance=acceptance, survival=(), tail_acceptance=None)

    def could_pay(self, maximum: int, acceptance: float = 1.0) -> bool:
        """Whether some k >= 1 would do at least as well as target-only decoding at this per-token acceptance
        (default: if every draft were accepted)."""
        return _could_pay(self, maximum, acceptance)

    def target_only_s(self) -> float:
        """Seconds per token without drafts: streamed (the loop streams every stretch without drafts), v(0); else a
        round with k = 0, its round trip included."""
        return self.verify_s(0) if self.target_streams else self.round_s(0)

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


def recent_drafted(rounds: Sequence[RoundRecord]) -> list[RoundRecord]:
    """The last WINDOW rounds that carried drafts (round 0, the prefill, left out): what is known about drafting,
    however long ago the policy last drafted."""
    found: list[RoundRecord] = []
    # Back from the last round, so the cost is the recent rounds', not the whole history's (the policy asks every
    # round, and again for every round it simulates ahead).
    for i in range(len(rounds) - 1, 0, -1):
        if rounds[i].drafted:
            found.append(rounds[i])
            if len(found) == WINDOW:
                break
    found.reverse()
    return found


def measured_acceptance(rounds: Sequence[RoundRecord]) -> float | None:
    """Maximum-likelihood per-token acceptance under the geometric model (each accepted draft token a success, each
    round that stopped before its last draft one failure), over recent drafted rounds; None without any."""
    drafted = recent_drafted(rounds)
    accepted = sum(r.accepted for r in drafted)
    stopped_early = sum(r.accepted < r.drafted for r in drafted)
    return accepted / (accepted + stopped_early) if accepted + stopped_early else None


def measured_survival(rounds: Sequence[RoundRecord]) -> tuple[float, ...]:
    """Kaplan-Meier estimate of P(the first j drafts are all accepted), j = 1, 2, ..., over recent drafted rounds, for
    as long as MIN_AT_RISK rounds reached position j. A round is at risk at j when it drafted j or more and accepted
    the first j - 1; it fails there when it accepted exactly j - 1."""
    drafted = recent_drafted(rounds)
    survival: list[float] = []
    reached = 1.0
    for j in range(1, max((r.drafted for r in drafted), default=0) + 1):
        at_risk = [r for r in drafted if r.drafted >= j and r.accepted >= j - 1]
        if len(at_risk) < MIN_AT_RISK:
            break
        reached *= 1.0 - sum(r.accepted == j - 1 for r in at_risk) / len(at_risk)
        survival.append(reached)
    return tuple(survival)


def run_acceptance(rounds: Sequence[RoundRecord]) -> float:
    """Per-token acceptance in the rounds that followed a fully accepted round (the drafter was following the text):
    what a fully accepted round promises for the next one. Recent such rounds, with RUN_PRIOR_TOKENS pseudo-tokens at
    PLAUSIBLE_ACCEPTANCE (bursty text: a run, once started, tends to go on)."""
    after_full = [r for previous, r in zip(rounds[1:], rounds[2:])
                  if previous.drafted and previous.accepted == previous.drafted and r.drafted][-WINDOW:]
    successes = sum(r.accepted for r in after_full) + RUN_PRIOR_TOKENS * PLAUSIBLE_ACCEPTANCE
    failures = sum(r.accepted < r.drafted for r in after_full) + RUN_PRIOR_TOKENS * (1 - PLAUSIBLE_ACCEPTANCE)
    return successes / (successes + failures)


def failed_probes(rounds: Sequence[RoundRecord]) -> int:
    """Probes in a row, counted back from the last round, after which drafting stopped again at once: drafted rounds
    alone between rounds without drafts. The policy waits twice as long before each further probe."""
    drafted = [r.drafted > 0 for r in rounds[1:]]
    count, i = 0, len(drafted) - 1
    while i >= 0 and not drafted[i]:
        i -= 1
    while i >= 1 and drafted[i] and not drafted[i - 1]:
        count += 1
        i -= 1
        while i >= 0 and not drafted[i]:
            i -= 1
    return count


def measured_tail_acceptance(rounds: Sequence[RoundRecord]) -> float | None:
    """Per-position acceptance beyond the first draft, over recent rounds whose first draft was accepted: the
    geometric estimate with one pseudo-failure, so that a few fully accepted rounds never promise endless runs."""
    reached_second = [r for r in recent_drafted(rounds) if r.accepted >= 1 and r.drafted >= 2]
    if not reached_second:
        return None
    successes = sum(r.accepted - 1 for r in reached_second)
    failures = sum(r.accepted < r.drafted for r in reached_second)
    return successes / (successes + failures + 1)


def measured_bet_hit(rounds: Sequence[RoundRecord]) -> float | None:
    """How often a pipelined bet was usable when every draft of its round was accepted (its first token predicted the
    target's own), over recent such rounds; None without any."""
    bets = [r.bet_won for r in rounds[1:] if r.bet_won is not None and r.drafted and r.accepted == r.drafted][-WINDOW:]
    return sum(bets) / len(bets) if bets else None


def measured_bet_slowdown(rounds: Sequence[RoundRecord], costs: CostEstimate) -> float:
    """How much slower verifies ran with a bet drafted alongside than without, each against what `costs` predict for
    its k (>= 1; 1 until MIN_BET_ROUNDS recent rounds had a bet). Without rounds lacking a bet, the prediction itself
    is the reference."""
    def ratio(selected: list[RoundRecord]) -> float:
        predicted = sum(costs.verify_round_trip_s + costs.verify_s(r.drafted) for r in selected)
        return sum(r.verify_s for r in selected) / predicted if predicted > 0 else 1.0
    betting = [r for r in rounds[1:] if r.bet_won is not None][-WINDOW:]
    if len(betting) < MIN_BET_ROUNDS:
        return 1.0
    plain = [r for r in rounds[1:] if r.bet_won is None][-WINDOW:]
    return max(1.0, ratio(betting) / (ratio(plain) if plain else 1.0))


def measured_drafting_slowdown(rounds: Sequence[RoundRecord], costs: CostEstimate) -> float:
    """How much longer this generation's drafted rounds took than `costs` price them, over the same ratio for its
    rounds without drafts (which share whatever the context length does to both), within [1/2, 4]; 1 until
    MIN_DRAFTED_ROUNDS rounds drafted. The workers measure their costs each alone, on a short context; in a
    generation the drafter and the verifier may share cores (the real pair on 2 cores: c 0.45 target steps at
    warm-up, 0.54 to 0.65 in the rounds, and every verify slower)."""
    drafted = recent_drafted(rounds)
    if len(drafted) < MIN_DRAFTED_ROUNDS:
        return 1.0

    def ratio(selected: list[RoundRecord]) -> float:
        predicted = sum(costs.round_s(r.drafted) for r in selected)
        return sum(r.draft_s + r.verify_s for r in selected) / predicted if predicted > 0 else 1.0
    plain = [r for r in rounds[1:] if not r.drafted][-WINDOW:]
    baseline = ratio(plain) if len(plain) >= MIN_DRAFTED_ROUNDS else 1.0
    return min(max(ratio(drafted) / max(baseline, 1e-9), 0.5), 4.0)


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
    return CostEstimate(acceptance, draft_s_per_token, base, slope, survival=measured_survival(rounds),
                        tail_acceptance=measured_tail_acceptance(rounds))


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
                            * measured_drafting_slowdown(rounds, prior))
        return prior if acceptance is None else replace(prior, acceptance=acceptance,
                                                        survival=measured_survival(rounds),
                                                        tail_acceptance=measured_tail_acceptance(rounds))

    def drafting_slowdown(self, rounds: Sequence[RoundRecord]) -> float | None:
        """The prior's drafting_slowdown as corrected by `rounds` (timed policies with a prior, once they have
        measured it); None otherwise."""
        if not self.length.timed or len(recent_drafted(rounds)) < MIN_DRAFTED_ROUNDS:
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
        return self.next(k, [*rounds, RoundRecord(k, k, draft_s, verify_s)])

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
