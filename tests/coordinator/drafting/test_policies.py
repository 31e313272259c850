"""Adaptive draft length: the heuristic, and the cost model that picks k from measured acceptance and timings."""

from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.api import round_trip_s
from coordinator.drafting.priors import cost_prior
from coordinator.drafting.estimators import (MIN_AT_RISK, MIN_DRAFTED_ROUNDS, estimate_costs, measured_bet_hit,
                                             measured_bet_slowdown, measured_survival, measured_tail_acceptance)
from coordinator.drafting.policies import POLICIES, PROBE_EVERY, PROBE_RARELY, drafting_pays
from coordinator.drafting.costs import PRIOR_ACCEPTANCE, CostEstimate
from coordinator.drafting.policies import DraftLength
from coordinator.drafting.rounds import RoundRecord


def rounds_from(pattern: list[tuple[int, int]], draft_s_per_token: float, verify_base: float,
                verify_per_token: float) -> list[RoundRecord]:
    """Rounds with exact timings: draft k*c, verify base + slope*k. A first (prefill) round is prepended."""
    prefill = RoundRecord(4, 0, 9.0, 9.0)  # absurd timings: the estimate must leave round 0 out
    return [prefill, *(RoundRecord(k, accepted, k * draft_s_per_token, verify_base + verify_per_token * k)
                       for k, accepted in pattern)]


def test_estimate_recovers_the_measured_costs():
    # 4 rounds: 3 + 4 + 1 + 2 accepted = 10 successes; rounds 1, 3 and 4 stopped early = 3 failures: a = 10/13.
    rounds = rounds_from([(4, 3), (4, 4), (2, 1), (6, 2)], 0.02, 0.3, 0.05)
    estimate = estimate_costs(rounds)
    got = (estimate.acceptance, estimate.draft_s_per_token, estimate.verify_s_base, estimate.verify_s_per_token)
    assert got == pytest.approx((10 / 13, 0.02, 0.3, 0.05))


def test_too_little_data_gives_no_estimate():
    assert estimate_costs(rounds_from([(4, 4), (4, 4)], 0.02, 0.3, 0.05)) is None
    assert estimate_costs(rounds_from([(4, 4)] * 5, 0.02, 0.3, 0.05)) is None, "one k only: v(k)'s slope unknown"


def test_expected_tokens_match_the_geometric_formula():
    estimate = CostEstimate(0.8, 0.0, 1.0, 0.0)
    assert estimate.expected_tokens(0) == pytest.approx(1.0)
    assert estimate.expected_tokens(3) == pytest.approx(1 + 0.8 + 0.64 + 0.512)
    assert CostEstimate(1.0, 0.0, 1.0, 0.0).expected_tokens(4) == pytest.approx(5.0, rel=1e-4)


@pytest.mark.parametrize("acceptance, draft_cost, slope, expected", [
    (0.95, 0.02, 0.0, 16),  # cheap draft, flat verify, high acceptance: draft as far as allowed
    (0.9, 0.1, 0.0, range(8, 13)),  # each draft token costs a tenth of a pass: k near 10, not 16
    (0.5, 0.3, 0.3, 0),  # poor acceptance, costly draft and verify: target-only is fastest
])
def test_best_k_follows_the_cost_model(acceptance, draft_cost, slope, expected):
    best = CostEstimate(acceptance, draft_cost, 1.0, slope).best_k(16)
    assert best in expected if isinstance(expected, range) else best == expected


def test_cost_policy_drafts_more_when_it_pays_and_falls_back_to_zero_when_not():
    policy = DraftLength(policy="cost")
    good = rounds_from([(4, 4), (6, 6), (8, 7), (5, 5)] * 2, 0.01, 0.5, 0.01)
    assert policy.next(4, good) > 6
    bad = rounds_from([(4, 0), (2, 1), (3, 0), (1, 0)] * 2, 0.2, 0.5, 0.3)
    assert policy.next(4, bad) == 0


def test_cost_policy_probes_now_and_then_while_at_zero():
    """Poor acceptance with drafts that would pay if accepted: probe every PROBE_EVERY rounds."""
    policy = DraftLength(policy="cost", minimum=1)
    bad = rounds_from([(4, 0), (2, 1), (3, 0), (1, 0)] * 2, 0.05, 0.5, 0.1)
    zeros = [RoundRecord(0, 0, 0.0, 0.5)] * (PROBE_EVERY - 2)
    assert policy.next(0, bad + zeros) == 0
    assert policy.next(0, bad + zeros + [RoundRecord(0, 0, 0.0, 0.5)]) == 1, "a probe round after a run of k = 0"


def test_cost_policy_probes_rarely_where_drafting_cannot_pay_at_all():
    """A draft token plus its verify share cost more than a target pass: even full acceptance loses, so acceptance is
    not worth measuring; only a rare probe notices changed costs."""
    policy = DraftLength(policy="cost", minimum=1)
    costly = rounds_from([(4, 4), (2, 2), (3, 3), (1, 1)] * 2, 0.4, 0.5, 0.4)
    assert not estimate_costs(costly).could_pay(16)
    zeros = [RoundRecord(0, 0, 0.0, 0.5)] * (PROBE_RARELY - 2)
    assert policy.next(0, costly + zeros[:PROBE_EVERY]) == 0
    assert policy.next(0, costly + zeros) == 0
    assert policy.next(0, costly + zeros + [RoundRecord(0, 0, 0.0, 0.5)]) == 1


def test_cost_policy_starts_from_the_workers_cost_prior():
    """Before any round, the workers' warm-up costs decide: k = 0 from the first round where drafting cannot pay,
    a long draft where drafts are cheap; measured acceptance then replaces the prior's."""
    slow_drafter = CostEstimate(PRIOR_ACCEPTANCE, 0.6, 1.0, 0.7)  # like a 0.5B draft for a 1.5B target on 2 cores
    assert DraftLength(policy="cost", prior=slow_drafter).first() == 0
    assert DraftLength(policy="cost", prior=slow_drafter).next(0, [RoundRecord(0, 0, 0.0, 1.0)]) == 0
    cheap = CostEstimate(PRIOR_ACCEPTANCE, 0.02, 1.0, 0.02)
    assert DraftLength(policy="cost", prior=cheap).first() >= 4
    one_rejected = [RoundRecord(0, 0, 0.0, 1.0), RoundRecord(6, 0, 0.12, 1.1)]
    assert DraftLength(policy="cost", prior=cheap).next(6, one_rejected) == 5, "one round is too little to tell"
    rejected = one_rejected + [RoundRecord(5, 0, 0.1, 1.1), RoundRecord(4, 0, 0.08, 1.1)]
    assert DraftLength(policy="cost", prior=cheap).next(4, rejected) == 0, "nothing accepted: drafting does not pay"
    assert DraftLength(policy="heuristic", prior=cheap).first() == 4  # the heuristic ignores costs


def test_cost_policy_uses_the_heuristic_until_it_has_data():
    policy = DraftLength(policy="cost")
    assert policy.next(4, [RoundRecord(4, 4, 0.1, 0.2)]) == 6
    with pytest.raises(ValueError, match="policy"):
        DraftLength(policy="fastest")


# Seconds as whole milliseconds: hypothesis refuses st.floats once a library loaded in the test process has set
# flush-to-zero (-ffast-math).
SECONDS = st.integers(1, 1000).map(lambda ms: ms / 1000)


@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(sorted(POLICIES)), k=st.integers(0, 8),
       rounds=st.lists(st.tuples(st.integers(0, 8), st.integers(0, 8), SECONDS, SECONDS), max_size=40))
def test_every_policy_stays_within_its_bounds(name, k, rounds):
    """Whatever the history, an adaptive policy drafts within [minimum, maximum], or nothing (cost policy only)."""
    length = DraftLength(initial=2, minimum=2, maximum=8, policy=name)
    history = [RoundRecord(drafted, min(accepted, drafted), draft_s, verify_s)
               for drafted, accepted, draft_s, verify_s in rounds]
    allowed = {*range(2, 9), *((0,) if name == "cost" else ())}
    assert length.first() in allowed and length.next(k, history) in allowed


# ---- round trips and the pipelined bet (split hosts) ----

def test_round_trips_make_drafting_pay_where_a_verify_is_far_and_not_where_the_drafter_is():
    near = CostEstimate(0.8, 0.1, 1.0, 0.1)
    assert replace(near, verify_round_trip_s=2.0).best_k(16) > near.best_k(16), \
        "a verify round trip is paid per round: longer drafts amortise it"
    slow_drafter = CostEstimate(0.9, 0.6, 1.0, 0.3)
    assert slow_drafter.best_k(16) == 0
    assert replace(slow_drafter, verify_round_trip_s=3.0).best_k(16) >= 1, "speculation amortises the round trip"
    far_drafter = CostEstimate(0.9, 0.1, 1.0, 0.1, draft_round_trip_s=5.0)
    assert far_drafter.best_k(16) == 0, "a Propose round trip longer than what drafting saves never pays"
    assert far_drafter.round_s(0) == pytest.approx(1.0), "a round without drafts makes no Propose call"


def test_pipelined_round_time_hides_the_draft_when_the_bet_wins():
    # verify 1 + 0.1*3 = 1.3 s; the bet drafts 4 tokens in 0.8 s during it; drafting 3 afresh costs 0.6 s.
    sure = CostEstimate(1.0, 0.2, 1.0, 0.1, pipelined=True, bet_hit=1.0)
    assert sure.round_s(3) == pytest.approx(1.3)
    assert replace(sure, bet_hit=0.5).round_s(3) == pytest.approx(1.3 + 0.5 * 0.6)
    assert replace(sure, pipelined=False).round_s(3) == pytest.approx(1.9)
    slow_bet = replace(sure, draft_s_per_token=0.5)  # the bet (2.0 s) outlasts the verify: it is waited for
    assert slow_bet.round_s(3) == pytest.approx(2.0)
    assert sure.round_s(0) == pytest.approx(1.0)
    partly = CostEstimate(0.8, 0.2, 1.0, 0.1, pipelined=True)  # no measured hit rate: the bet's token is a draft
    assert partly.round_s(3) == pytest.approx(1.3 + (1 - 0.8 ** 4) * 0.6)


def test_the_cost_policy_drafts_where_only_the_pipelined_bet_makes_it_pay():
    prior = CostEstimate(0.8, 0.55, 1.0, 0.3)  # a draft token plus its verify share cost 0.85 of a target pass
    # Only near-certain acceptance would pay unpipelined: it starts at k = 0 (a probe will measure this text's
    # acceptance); the bet hides the drafting, so pipelined drafting pays at the prior's acceptance: it starts drafting.
    assert DraftLength(policy="cost", prior=prior).drafting_off() is None, "at 90% acceptance k = 1 would pay"
    assert DraftLength(policy="cost", prior=prior).first() == 0
    assert DraftLength(policy="cost", prior=prior, pipelined=True).first() == 4
    rounds = [RoundRecord(0, 0, 0.0, 1.0), RoundRecord(4, 3, 2.2, 2.2), RoundRecord(3, 3, 1.65, 1.9),
              RoundRecord(5, 4, 2.75, 2.5)]
    # At 83% acceptance the drafts cost more than they are worth...
    assert DraftLength(policy="cost", prior=prior).next(5, rounds) == 0
    # ... unless the drafter, on its own core, drafts during the verify
    assert DraftLength(policy="cost", prior=prior, pipelined=True).next(5, rounds) >= 1


def test_bet_hit_rate_counts_fully_accepted_rounds_with_a_bet():
    rounds = [RoundRecord(4, 4, 9.0, 9.0, bet_won=False),  # round 0 (prefill): left out
              RoundRecord(4, 4, 0.1, 0.2, bet_won=True), RoundRecord(4, 4, 0.1, 0.2, bet_won=False),
              RoundRecord(4, 2, 0.1, 0.2, bet_won=False),  # lost on a rejected draft: says nothing about the guess
              RoundRecord(4, 4, 0.1, 0.2, bet_won=True), RoundRecord(4, 4, 0.1, 0.2)]
    assert measured_bet_hit(rounds) == pytest.approx(2 / 3)
    assert measured_bet_hit(rounds[:1]) is None


def test_the_bet_drafts_what_the_policy_would_draft_after_a_full_acceptance():
    assert DraftLength(policy="heuristic").after_full_acceptance(4, [], 0.1) == 6
    assert DraftLength(policy="heuristic", maximum=5).after_full_acceptance(4, [], 0.1) == 5
    assert DraftLength.fixed(3).after_full_acceptance(3, [], 0.1) == 3
    never = CostEstimate(0.8, 0.6, 1.0, 0.7)  # drafting cannot pay: no next draft, so no bet
    assert DraftLength(policy="cost", prior=never).after_full_acceptance(2, [RoundRecord(0, 0, 0.0, 1.0)], 0.1) == 0


def test_costs_are_validated():
    with pytest.raises(ValueError, match="probabilities"):
        CostEstimate(1.5, 0.1, 1.0, 0.1)
    with pytest.raises(ValueError, match=">= 0"):
        CostEstimate(0.5, 0.1, 1.0, 0.1, verify_round_trip_s=-1.0)


def test_the_prior_counts_round_trips_in_whole_milliseconds():
    verifier = SimpleNamespace(verify_base_s=0.4, verify_per_draft_s=0.05)
    drafter = SimpleNamespace(draft_per_token_s=0.1)
    prior = cost_prior(verifier, drafter, {"verifier": 0.0207, "drafter": 0.0004})
    assert (prior.verify_round_trip_s, prior.draft_round_trip_s) == pytest.approx((0.020, 0.0))
    assert cost_prior(verifier, drafter).verify_round_trip_s == 0.0
    assert cost_prior(SimpleNamespace(verify_base_s=0.0, verify_per_draft_s=0.0), drafter) is None


def test_no_prior_while_a_worker_running_a_model_has_not_measured_its_costs():
    """Workers measure their costs after SERVING when they are not cached, and report 0 until then: the cost policy
    then has no prior (it times its own rounds), never one that prices a draft model's tokens at 0 s."""
    verifier = SimpleNamespace(role="verifier", engine="ik", verify_base_s=0.4, verify_per_draft_s=0.05)
    unmeasured_model = SimpleNamespace(role="drafter", engine="ik", draft_per_token_s=0.0)
    assert cost_prior(verifier, unmeasured_model) is None
    assert cost_prior(replace_info(verifier, verify_base_s=0.0, verify_per_draft_s=0.0),
                      replace_info(unmeasured_model, draft_per_token_s=0.1)) is None
    no_model = SimpleNamespace(role="drafter", engine="", draft_per_token_s=0.0)  # n-gram, suffix: nothing to measure
    assert cost_prior(verifier, no_model).draft_s_per_token == 0.0
    # Without a prior from workers that report none, the cost policy starts from the heuristic's k and never rules
    # drafting out before a round.
    length = DraftLength(policy="cost", prior=cost_prior(verifier, unmeasured_model))
    assert length.first() == DraftLength.initial and length.drafting_off() is None
    assert length.next(length.first(), [RoundRecord(0, 0, 0.0, 0.5), RoundRecord(4, 4, 0.2, 0.3)]) == 6
    # While they are still measuring them, it drafts nothing (it never drafts blind); the heuristic still drafts.
    pending = DraftLength(policy="cost", prior=None, costs_pending=True)
    assert str(pending.drafting_off()).startswith("drafting off: the workers have not measured their costs yet")
    assert DraftLength(policy="heuristic", costs_pending=True).drafting_off() is None


def replace_info(info: SimpleNamespace, **fields) -> SimpleNamespace:
    return SimpleNamespace(**{**vars(info), **fields})


def test_the_coordinator_reads_the_costs_again_until_the_workers_report_them():
    """A coordinator that connected before its workers measured their costs reads their Info again before a
    generation, at most every COST_REFRESH_S, until they report them; then the generations start from the prior."""
    from coordinator import api
    from coordinator.fleet.worker_client import WorkerError

    measured = SimpleNamespace(role="verifier", engine="ik", verify_base_s=0.4, verify_per_draft_s=0.05)
    answers = iter([WorkerError("verifier: Info failed: DEADLINE_EXCEEDED"),
                    replace_info(measured, verify_base_s=0.0, verify_per_draft_s=0.0), measured])
    reads = []

    def info(timeout_s):
        reads.append(timeout_s)
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    pool = SimpleNamespace(first_serving=lambda: SimpleNamespace(address="v:1", info=info))
    coordinator = api.Coordinator.__new__(api.Coordinator)  # the costs only: no workers
    vars(coordinator).update(
        verifier_info=replace_info(measured, verify_base_s=0.0, verify_per_draft_s=0.0),
        drafter_info=SimpleNamespace(role="drafter", engine="", draft_per_token_s=0.0), suffix_drafter_info=None,
        verifiers=pool, drafters=None, suffix_drafters=None, round_trip_s={}, _model_round_trip_s={},
        _costs_read_at=time.monotonic(), _costs_lock=api.threading.Lock())
    coordinator._set_cost_priors()
    assert coordinator.cost_prior is None and coordinator.costs_pending()
    for wait, expected_reads in ((1.0, 0), (api.COST_REFRESH_S, 1), (api.COST_REFRESH_S, 2), (1.0, 2),
                                 (api.COST_REFRESH_S, 3), (api.COST_REFRESH_S, 3)):
        coordinator._costs_read_at -= wait  # as if `wait` seconds had passed since the last read
        coordinator._refresh_costs()
        assert len(reads) == expected_reads, (wait, reads)
    assert not coordinator.costs_pending() and coordinator.cost_prior.verify_s_base == 0.4


def test_round_trip_is_the_fastest_health_check():
    delays = iter([0.3, 0.1, 0.2])  # far apart: a loaded machine oversleeps by some ms

    def is_serving(timeout_s):
        time.sleep(next(delays))
        return True
    endpoint = SimpleNamespace(serving=True, client=SimpleNamespace(is_serving=is_serving))
    assert 0.1 <= round_trip_s(SimpleNamespace(endpoints=[endpoint]), probes=3) < 0.2
    down = SimpleNamespace(serving=False, client=SimpleNamespace(is_serving=lambda timeout_s: False))
    assert round_trip_s(SimpleNamespace(endpoints=[down]), probes=2) == 0.0


def test_a_bet_that_costs_more_than_it_saves_is_not_placed():
    # Rarely accepted, slow drafts: the 3-token bet (3 s) outlasts the verify (0.5 s) and almost always loses.
    costly = CostEstimate(0.3, 1.0, 0.5, 0.0, pipelined=True)
    assert not costly.bet_pays(2)
    assert costly.round_s(2) == pytest.approx(2.5), "without a bet a round costs what an unpipelined one does"
    prior = replace(costly, pipelined=False)
    assert not DraftLength(policy="cost", prior=prior, pipelined=True).bet_pays(2, [])
    assert DraftLength(policy="cost", prior=CostEstimate(0.9, 0.1, 1.0, 0.0), pipelined=True).bet_pays(2, [])
    assert DraftLength(policy="heuristic", prior=prior, pipelined=True).bet_pays(2, []), "no costs: always bet"
    assert not CostEstimate(0.9, 0.1, 1.0, 0.0).bet_pays(2), "not pipelined: no bet"


def test_a_bet_that_slows_the_verify_stops_being_placed():
    """Shared hardware: verifies ran 2.4x slower while a bet was drafted than without one; measured over three bets,
    that makes the bet cost more than it saves."""
    prior = CostEstimate(0.9, 0.2, 1.0, 0.1)
    length = DraftLength(policy="cost", prior=prior, pipelined=True)
    plain = [RoundRecord(4, 4, 0.8, 1.4)] * 3
    slowed = [RoundRecord(4, 4, 0.1, 1.4 * 2.4, bet_won=True)] * 3
    prefill = [RoundRecord(4, 4, 9.0, 9.0)]
    assert measured_bet_slowdown(prefill + plain + slowed, prior) == pytest.approx(2.4)
    assert measured_bet_slowdown(prefill + plain + slowed[:2], prior) == 1.0, "too few bets measured yet"
    assert length.bet_pays(4, prefill + plain), "the bet is free as far as anyone knows"
    assert not length.bet_pays(4, prefill + plain + slowed)
    free = [RoundRecord(4, 4, 0.1, 1.4, bet_won=True)] * 3
    assert length.bet_pays(4, prefill + plain + free)
    with pytest.raises(ValueError, match="bet_slowdown"):
        CostEstimate(0.9, 0.2, 1.0, 0.1, bet_slowdown=0.5)


def test_survival_is_the_kaplan_meier_estimate_with_fully_accepted_rounds_censored():
    # Positions 1..4. At 1: 5 at risk, 1 fails (accepted 0). At 2: 4 at risk, 1 fails (accepted 1). At 3: the 2 rounds
    # that accepted all of their 2 drafts leave (censored), 1 at risk: too few to estimate on its own.
    rounds = rounds_from([(2, 2), (2, 2), (4, 0), (4, 1), (4, 4)], 0.02, 0.3, 0.05)
    assert measured_survival(rounds) == pytest.approx((4 / 5, 4 / 5 * 3 / 4))
    # Beyond the first draft: 1 + 1 + 0 + 3 successes, one failure (the (4, 1) round), one pseudo-failure.
    assert measured_tail_acceptance(rounds) == pytest.approx(5 / 7)


def test_bursty_acceptance_is_estimated_from_the_runs_themselves():
    """Whole rounds accepted, or the first draft rejected (code, quoted input): the geometric model, fitted to such
    rounds, misjudges long drafts; the measured survival gives the tokens per round those rounds really had."""
    bursty = rounds_from([(3, 3)] + [(6, 6), (6, 6), (6, 0)] * 6, 0.4, 1.0, 0.2)  # (3, 3): a second k, v(k) slope
    estimate = estimate_costs(bursty)
    assert len(estimate.survival) >= 6 and estimate.survival[0] == pytest.approx(estimate.survival[5])
    measured = sum(r.accepted + 1 for r in bursty[2:]) / len(bursty[2:])  # the k = 6 rounds: 2/3 x 7 + 1/3 x 1
    geometric = replace(estimate, survival=(), tail_acceptance=None)
    assert abs(estimate.expected_tokens(6) - measured) < 0.2 < 0.5 < abs(geometric.expected_tokens(6) - measured)


def test_independent_acceptance_gives_about_the_geometric_answer():
    pattern = [(8, 0), (8, 2), (8, 1), (8, 4), (8, 0), (8, 3), (8, 1), (8, 8), (8, 2), (8, 0)] * 3
    estimate = estimate_costs(rounds_from([(4, 1)] + pattern, 0.1, 1.0, 0.1))
    geometric = replace(estimate, survival=(), tail_acceptance=None)
    assert len(estimate.survival) >= MIN_AT_RISK - 1
    assert estimate.expected_tokens(8) == pytest.approx(geometric.expected_tokens(8), rel=0.15)
    assert abs(estimate.best_k(16) - geometric.best_k(16)) <= 1


def test_survival_must_be_a_non_increasing_probability():
    with pytest.raises(ValueError, match="survival"):
        CostEstimate(0.8, 0.1, 1.0, 0.1, survival=(0.5, 0.7))
    with pytest.raises(ValueError, match="tail_acceptance"):
        CostEstimate(0.8, 0.1, 1.0, 0.1, survival=(0.5,), tail_acceptance=1.5)


# ---- the verify cost curve, and following runs ----

# The real pair's costs on this project's 2-core CPU (transformers engine, float32, seconds): a verify with 0, 1, 4, 8
# and 16 drafts, and a draft token. One row is a matrix-vector product, two or more a matrix-matrix one.
REAL_CURVE = ((0, 0.47), (1, 0.78), (4, 0.92), (8, 1.03), (16, 1.32))
REAL_DRAFT_S = 0.164


def test_verify_cost_follows_the_measured_curve():
    costs = CostEstimate(0.7, REAL_DRAFT_S, 0.47, 0.11, verify_curve=REAL_CURVE)
    assert [costs.verify_s(k) for k in (0, 1, 4, 16)] == pytest.approx([0.47, 0.78, 0.92, 1.32])
    assert costs.verify_s(2) == pytest.approx(0.78 + 0.14 / 3), "between points: linear"
    assert costs.verify_s(20) == pytest.approx(1.32 + 4 * 0.29 / 8), "past the last point: the last segment's slope"
    assert CostEstimate(0.7, 0.1, 0.5, 0.1).verify_s(4) == pytest.approx(0.9), "no curve: the line"
    for bad in [((1, 0.5), (4, 0.9)), ((0, 0.5), (4, 0.9), (2, 0.7)), ((0, -0.1),)]:
        with pytest.raises(ValueError, match="verify_curve"):
            CostEstimate(0.7, 0.1, 0.5, 0.1, verify_curve=bad)


def test_the_curve_prices_long_drafts_at_what_they_cost():
    """A line through 0 and 4 drafts prices 16 drafts at 2.3 s where they cost 1.32 s, and 1 draft at 0.58 s where
    it costs 0.78 s: with the curve, long drafts pay and a single draft does not; the line says the opposite."""
    curve = CostEstimate(0.95, REAL_DRAFT_S, 0.47, (0.92 - 0.47) / 4, verify_curve=REAL_CURVE)
    line = replace(curve, verify_curve=())
    assert line.verify_s(16) > 1.5 * curve.verify_s(16)
    assert curve.best_k(16) >= 8 > line.best_k(16)
    assert curve.tokens_per_s(1) < curve.tokens_per_s(0) < line.tokens_per_s(1)


def test_the_prior_reads_the_verifiers_cost_curve():
    drafter = SimpleNamespace(draft_per_token_s=0.1)
    points = [SimpleNamespace(drafts=k, seconds=s) for k, s in reversed(REAL_CURVE)]
    verifier = SimpleNamespace(verify_base_s=0.47, verify_per_draft_s=0.11, verify_costs=points)
    assert cost_prior(verifier, drafter).verify_curve == REAL_CURVE
    older = SimpleNamespace(verify_base_s=0.47, verify_per_draft_s=0.11)  # a verifier that sends only the line
    assert cost_prior(older, drafter).verify_curve == ()


def test_the_cost_policy_follows_a_run_and_stops_where_drafting_does_not_pay():
    prior = CostEstimate(PRIOR_ACCEPTANCE, REAL_DRAFT_S, 0.47, 0.11, verify_curve=REAL_CURVE)
    policy = DraftLength(policy="cost", prior=prior)
    assert policy.drafting_off() is None and policy.first() == 0, \
        "drafting could pay at 90% acceptance, not at the prior's 70%: start target-only, a probe measures"
    poor = [RoundRecord(0, 0, 0.0, 0.5), *[RoundRecord(6, 1, 1.0, 1.0)] * MIN_DRAFTED_ROUNDS]
    assert not drafting_pays(poor, prior) and policy.next(6, poor) == 0
    # The same rounds followed by a fully accepted one: the drafter is following the text, keep drafting longer.
    assert drafting_pays([*poor, RoundRecord(1, 1, 0.2, 0.8)], prior)
    assert policy.next(1, [*poor, RoundRecord(1, 1, 0.2, 0.8)]) >= 3
    good = [RoundRecord(0, 0, 0.0, 0.5), *[RoundRecord(8, 7, 1.3, 1.0)] * MIN_DRAFTED_ROUNDS]
    assert drafting_pays(good, prior) and policy.next(8, good) >= 7, "a rejection among long accepted runs"
    never = DraftLength(policy="cost", prior=CostEstimate(0.7, 0.6, 1.0, 0.7))
    assert never.first() == 0 and never.next(0, [RoundRecord(0, 0, 0.0, 1.0), RoundRecord(4, 4, 2.4, 3.8)]) == 0, \
        "drafting cannot pay even when every draft is accepted: a full round does not restart it"


def simulated_speedup(policy: DraftLength, runs: list[int], costs: CostEstimate) -> float:
    """Tokens per second of `policy` over a text where the drafter agrees with the target for runs[p] tokens from
    position p on, priced by `costs`, relative to target-only decoding."""
    position, rounds, seconds, k = 0, [], 0.0, policy.first()
    while position < len(runs):
        drafted = min(k, len(runs) - position - 1)
        accepted = min(runs[position], drafted)
        rounds.append(RoundRecord(drafted, accepted, drafted * costs.draft_s_per_token, costs.verify_s(drafted)))
        seconds += costs.round_s(drafted)
        position += accepted + 1
        k = policy.next(k, rounds)
    return len(runs) / seconds * costs.round_s(0)


def run_lengths(agrees: list[bool]) -> list[int]:
    """runs[p]: how many positions from p on the drafter agrees with the target."""
    runs, following = [], 0
    for agree in reversed(agrees):
        following = following + 1 if agree else 0
        runs.append(following)
    return runs[::-1]


@pytest.mark.parametrize("seed", range(4))
def test_the_cost_policy_keeps_up_with_the_heuristic_on_bursty_text_and_beats_it_on_poor_text(seed):
    """Simulated on the real pair's costs: bursty text (long agreeing runs between disagreements, as in code and
    quoted input) and poor text (each token agrees with probability 0.6, independently, as in prose)."""
    import random
    rng = random.Random(seed)
    bursty: list[bool] = []
    while len(bursty) < 256:
        bursty += [False] * rng.choice([1, 1, 2]) + [True] * rng.choice([3, 6, 10, 20, 35])
    poor = [rng.random() < 0.6 for _ in range(256)]
    costs = CostEstimate(PRIOR_ACCEPTANCE, REAL_DRAFT_S, 0.47, 0.11, verify_curve=REAL_CURVE)
    cost, heuristic = DraftLength(policy="cost", prior=costs), DraftLength(policy="heuristic")
    on_bursty = [simulated_speedup(p, run_lengths(bursty[:256]), costs) for p in (cost, heuristic)]
    assert on_bursty[0] > 1.1 and on_bursty[0] >= 0.9 * on_bursty[1]
    on_poor = [simulated_speedup(p, run_lengths(poor), costs) for p in (cost, heuristic)]
    assert on_poor[0] >= 0.85 and on_poor[0] > on_poor[1]


# ---- never slower by default: what a full round promises, probes that back off, a plausible ceiling ----

def test_a_fully_accepted_round_keeps_drafting_only_where_a_run_can_pay():
    """After a full acceptance the policy keeps drafting where the run acceptance (0.9 until rounds after full
    acceptances measured it) pays for the drafts, not merely because the round was full."""
    from coordinator.drafting.estimators import run_acceptance
    history = [RoundRecord(0, 0, 0.0, 1.0), RoundRecord(2, 0, 0.2, 1.2), RoundRecord(2, 2, 0.2, 1.2)]
    assert run_acceptance(history) == pytest.approx(0.9)
    cheap = CostEstimate(0.5, 0.05, 1.0, 0.05)
    steep = CostEstimate(0.5, 0.5, 1.0, 0.5)  # pays only near full acceptance: 1.9 / 2.0 at 90%, k = 1
    assert steep.could_pay(16) and not steep.could_pay(16, 0.9)
    assert drafting_pays(history, cheap) and not drafting_pays(history, steep)
    # Runs that broke off right after a full round: the run acceptance falls, and drafting stops even when cheap-ish.
    broken = history + [RoundRecord(4, 0, 0.2, 1.2), RoundRecord(2, 2, 0.1, 1.1), RoundRecord(4, 0, 0.2, 1.2),
                        RoundRecord(2, 2, 0.1, 1.1)]
    assert run_acceptance(broken) == pytest.approx((0 + 3.6) / (2 + 4))
    middling = CostEstimate(0.5, 0.35, 1.0, 0.3)  # k = 1: 1.9 / 1.65 at 90%, 1.6 / 1.65 at 60%
    assert drafting_pays(history, middling) and not drafting_pays(broken, middling)


def test_each_failed_probe_doubles_the_wait_for_the_next():
    from coordinator.drafting.policies import PROBE_MAX_GAP
    from coordinator.drafting.estimators import failed_probes
    zero, probe = RoundRecord(0, 0, 0.0, 1.0), RoundRecord(1, 0, 0.1, 1.1)
    assert failed_probes([zero, zero, zero]) == 0
    assert failed_probes([zero, RoundRecord(4, 4, 0.1, 1.1), RoundRecord(4, 1, 0.1, 1.1), zero]) == 0, \
        "drafting went on after its first round: not a failed probe"
    assert failed_probes([zero, *[zero] * 7, probe, *[zero] * 15, probe, zero]) == 2
    policy = DraftLength(policy="cost", minimum=1)
    bad = rounds_from([(4, 0), (2, 1), (3, 0), (1, 0)] * 2, 0.05, 0.5, 0.1)
    history, probes = list(bad), []
    while len(history) < 600:
        k = policy.next(0, history)
        if k:
            probes.append(len(history))
        history.append(RoundRecord(k, 0, 0.05 * k, 0.5 + 0.1 * k))
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[:4] == [2 * PROBE_EVERY, 4 * PROBE_EVERY, 8 * PROBE_EVERY, PROBE_MAX_GAP]
    assert set(gaps[4:]) == {PROBE_MAX_GAP}


def test_drafting_is_off_where_even_plausible_acceptance_cannot_pay():
    """Pays a little at full acceptance, loses at 90%: off, and the reason says both."""
    from coordinator.drafting.costs import PLAUSIBLE_ACCEPTANCE
    marginal = CostEstimate(PRIOR_ACCEPTANCE, 0.5, 1.0, 0.42)  # k = 4: 5 / 4.68 with every draft accepted
    assert marginal.could_pay(16) and not marginal.could_pay(16, PLAUSIBLE_ACCEPTANCE)
    length = DraftLength(policy="cost", prior=marginal)
    off = length.drafting_off()
    assert off is not None and off.best_speedup > 1.0 > off.plausible_speedup
    assert length.first() == 0 and all(length.next(0, [RoundRecord(0, 0, 0.0, 1.0)] * n) == 0 for n in range(1, 300))
    assert "with every draft accepted" in str(off) and "at 90% acceptance" in str(off)
