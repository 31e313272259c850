"""What the rounds so far measured: acceptance, run lengths, the bet's hit rate, how much slower than the workers'
costs the drafted rounds ran, and a cost model fitted to round timings where the workers report no costs.

Acceptance is bursty: where the draft model follows the text (code, quoted input) whole rounds are accepted, where
it does not the first draft already fails. Per token, E(k) = (1 - a^(k+1)) / (1 - a) (Leviathan et al.), a the
per-token acceptance. That geometric E(k), fitted to such rounds, underestimates long drafts
(the transformers bench: 3.6 tokens per round predicted at k = 7, 6.2 measured), and a policy that trusts it drafts 2
where 7 pays. So once the generation has drafted, E(k) = 1 + S(1) + ... + S(k) with S(j), the probability that the
first j drafts are all accepted, measured by the Kaplan-Meier estimator over the recent rounds (a round that
accepted all its k drafts says only that its run reached k: right-censored). Past the positions enough rounds
reached, S decays at the per-position acceptance measured beyond the first draft (with one pseudo-failure, so that
a few fully accepted rounds never promise endless runs).
"""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.drafting.costs import PLAUSIBLE_ACCEPTANCE, CostEstimate
from coordinator.drafting.rounds import RoundRecord

WINDOW = 32  # recent rounds the cost model looks at: the text changes character within a generation
# Run acceptance (after a fully accepted round) is estimated with this many pseudo-tokens at PLAUSIBLE_ACCEPTANCE.
RUN_PRIOR_TOKENS = 4
MIN_DRAFTED_ROUNDS = 3  # below this the cost model has too little data and the heuristic decides
MIN_BET_ROUNDS = 3  # pipelined rounds measured before their verifies' slowdown counts
MIN_AT_RISK = 4  # rounds that must have reached a draft position before its acceptance is estimated on its own


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


def measured_drafting_slowdown(rounds: Sequence[RoundRecord], costs: CostEstimate, source: str = "") -> float:
    """How much longer this generation's drafted rounds of `source` (RoundRecord.source) took than `costs` price
    them, over the same ratio for its rounds without drafts (which share whatever the context length does to both),
    within [1/2, 4]; 1 until MIN_DRAFTED_ROUNDS such rounds drafted. The workers measure their costs each alone, on a
    short context; in a generation the drafter and the verifier may share cores (the real pair on 2 cores: c 0.45
    target steps at warm-up, 0.54 to 0.65 in the rounds, and every verify slower). Only the source's own rounds:
    another source's (a draft model's, priced at a suffix drafter's costs) would say nothing of these costs."""
    drafted = [r for r in recent_drafted(rounds) if r.source == source]
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
