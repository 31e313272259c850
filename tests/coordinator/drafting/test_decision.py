"""What the cost policy decides before and during a generation, seen on fake workers
(tests/coordinator/fleet/fake_workers.py): where no draft length pays by the workers' cost curves, the drafter is never
called and no drafter session is opened; where drafting pays but acceptance is poor, k = 0 with probe rounds that
never make the drafter catch up a long backlog; and the summary line and the --json stats say what was decided and
why."""

from __future__ import annotations

import logging
import statistics
from dataclasses import replace
from types import SimpleNamespace

import pytest

from coordinator.api import summarize
from coordinator.cli import print_summary
from coordinator.drafting.costs import PLAUSIBLE_ACCEPTANCE, PRIOR_ACCEPTANCE, CostEstimate
from coordinator.drafting.learned import STREAM as STREAMED_MEASURE
from coordinator.drafting.policies import PROBE_EVERY, PROBE_MAX_GAP
from coordinator.drafting.policies import DraftLength
from coordinator.fleet.pools import WorkerPool
from coordinator.loop import LoopConfig, LoopResult, speculative_decode
from coordinator.fleet.polling import wait_until
from coordinator.fleet.remote_sessions import (MAX_DRAFTER_BACKLOG, RESTART_CONTEXT, DegradingDraftSession,
                                         FailoverTargetSession, FaultStats, LazyDraftSource)
from coordinator.fleet.resilience import ResilienceConfig
from specmesh.decoding.sampling import SamplingParams
from tests.coordinator.fleet.fake_workers import FakeFleet, target_continuation

PROMPT = [3, 14, 15, 9, 26]
# A drafter whose failures never open its breaker: an outage is exactly as long as a test makes it.
CONFIG = ResilienceConfig(verify_timeout_s=1.0, propose_timeout_s=1.0, retry_budget_s=3.0, backoff_initial_s=0.001,
                          backoff_max_s=0.01, breaker_fail_max=10_000, breaker_reset_s=60.0)

# Cost curves as the workers report them (Info): the verifier's v(k) and the drafter's seconds per token.
# A verify whose cost grows by more than a target step with each draft: no k pays, even with every draft accepted and
# the drafting hidden behind the verify (pipelined).
NOTHING_PAYS = CostEstimate(PRIOR_ACCEPTANCE, 0.6, 1.0, 1.2, verify_curve=((0, 1.0), (1, 2.2), (4, 5.8), (16, 20.2)))
# Cheap drafts and a flat verify: drafting pays wherever drafts are accepted.
DRAFTING_PAYS = CostEstimate(PRIOR_ACCEPTANCE, 0.02, 1.0, 0.02, verify_curve=((0, 1.0), (1, 1.02), (16, 1.3)))


def test_with_the_workers_costs_a_policy_that_cannot_pay_never_probes():
    """The workers' costs hold for the whole generation: where they rule drafting out, no probe either (without them,
    round timings could change, and a rare probe still looks)."""
    from coordinator.drafting.policies import PROBE_RARELY
    from coordinator.drafting.rounds import RoundRecord
    never = DraftLength(policy="cost", prior=NOTHING_PAYS)
    off = never.drafting_off()
    assert off is not None and never.first() == 0 and off.best_k == 1
    assert off.best_speedup == pytest.approx(2 / 2.8)  # 2 tokens per 2.2 + 0.6 target steps at best
    zeros = [RoundRecord(0, 0, 0.0, 1.0)] * (3 * PROBE_RARELY)
    assert all(never.next(0, zeros[:n]) == 0 for n in range(1, len(zeros) + 1))
    assert DraftLength(policy="cost", prior=DRAFTING_PAYS).drafting_off() is None
    assert DraftLength(policy="heuristic", prior=NOTHING_PAYS).drafting_off() is None, "the heuristic ignores costs"
    assert DraftLength.fixed(3).drafting_off() is None, "a fixed k is what the user asked for"


@pytest.fixture
def fleets():
    """(verifier pool, drafter pool, drafter FakeFleet) -> a function of the drafter's draft_error_at; closed after."""
    pools: list[WorkerPool] = []

    def make(draft_error_at: int | None = None):
        made = []
        for role in ("verifier", "drafter"):
            fleet = FakeFleet(role, 1, draft_error_at if role == "drafter" else None)
            pool = WorkerPool(fleet.addresses, role, CONFIG, connect=fleet.connect)
            pools.append(pool)
            assert wait_until(lambda: all(e.serving for e in pool.endpoints), 5.0)
            made.append((pool, fleet))
        (verifiers, _), (drafters, drafter_fleet) = made
        return verifiers, drafters, drafter_fleet

    yield make
    for pool in pools:
        pool.close()


def generate(verifiers, drafters, prior: CostEstimate | None, max_new_tokens: int, pipeline: bool = False,
             length: DraftLength | None = None, after_round=None):
    """One generation as Coordinator.generate runs it: a lazily opened drafter session and a verifier session over the
    pools, the real loop. Returns (loop result, the lazy drafter source, fault stats, sessions opened)."""
    stats, opened = FaultStats(), []

    def open_session(history: list[int]) -> DegradingDraftSession:
        opened.append(list(history))
        return DegradingDraftSession(drafters, "s1", history, SamplingParams(), 0, CONFIG, stats)
    drafter = LazyDraftSource(PROMPT, open_session)
    target = FailoverTargetSession(verifiers, "s1", PROMPT, SamplingParams(), 0, CONFIG, stats)
    length = length or DraftLength(policy="cost", prior=prior, pipelined=pipeline)
    seen: list[int] = []

    def on_tokens(new: list[int]) -> bool:
        seen.extend(new)
        if after_round is not None:
            after_round(seen)
        return False
    try:
        result = speculative_decode(drafter, target, LoopConfig(max_new_tokens, draft_length=length,
                                                                pipeline=pipeline), on_tokens=on_tokens)
    finally:
        target.end()
        drafter.end()
    return result, drafter, stats, opened


@pytest.mark.parametrize("pipeline", [False, True])
def test_where_no_draft_length_pays_the_drafter_is_never_called(fleets, pipeline, caplog):
    verifiers, drafters, drafter_fleet = fleets()  # a perfect drafter: every draft would be accepted
    assert not NOTHING_PAYS.could_pay(16)
    with caplog.at_level(logging.INFO, logger="specmesh.coordinator"):
        result, drafter, _, opened = generate(verifiers, drafters, NOTHING_PAYS, 100, pipeline)

    assert result.tokens == target_continuation(PROMPT, 100)
    assert all(r.drafted == 0 for r in result.rounds), "no round drafts, not even a probe"
    stub = drafter_fleet[0].stub
    assert stub.requests == [] and stub.sessions == {}, "not one call reaches the drafter: no Propose, no session"
    assert opened == [] and drafter.source is None, "the drafter session is never opened"
    assert drafters.endpoints[0].sessions == 0 and stub.ended == [], "nothing pinned, nothing to end"
    assert result.drafting_off and result.draft_decision.startswith("drafting off: no draft length pays")
    # The decision is logged once, with the numbers: c and v(k) in target steps, and the bound.
    logged = [r.getMessage() for r in caplog.records if "drafting off" in r.getMessage()]
    assert len(logged) == 1
    assert "c=0.60 of a target step" in logged[0] and "v(1)=2.20" in logged[0] and "v(4)=5.80" in logged[0]
    # The best k = 1: 2 tokens per 2.2 + 0.6 target steps, or per 2.2 when the bet hides the drafting (pipelined).
    assert f"best possible {0.91 if pipeline else 0.71:.2f}x" in logged[0] and "target-only 1 s per token" in logged[0]


def test_a_generation_that_drafts_opens_the_drafter_session_on_its_first_draft(fleets):
    verifiers, drafters, drafter_fleet = fleets()
    result, drafter, _, opened = generate(verifiers, drafters, DRAFTING_PAYS, 40)
    assert result.tokens == target_continuation(PROMPT, 40)
    assert opened == [PROMPT] and result.rounds[0].drafted > 0, "opened for round 0, with the prompt"
    assert not result.drafting_off and result.draft_decision == "adaptive k (cost policy)"
    assert drafter_fleet[0].stub.ended == ["s1"]


def test_poor_acceptance_probes_without_making_the_drafter_catch_up_a_backlog(fleets):
    """Drafting would pay, but the drafter's first draft is always wrong: k = 0 after a few rounds, then a probe now
    and then, each failed probe doubling the wait for the next (PROBE_EVERY rounds, then 2x, 4x, ... up to
    PROBE_MAX_GAP). No probe sends the drafter more than MAX_DRAFTER_BACKLOG tokens to catch up on."""
    verifiers, drafters, drafter_fleet = fleets(draft_error_at=0)
    result, _, faults, _ = generate(verifiers, drafters, DRAFTING_PAYS, 300)

    assert result.tokens == target_continuation(PROMPT, 300)
    drafted = [i for i, r in enumerate(result.rounds) if r.drafted]
    probes = [i for i in drafted if i > 0 and not result.rounds[i - 1].drafted]
    assert len(probes) >= 4 and len(drafted) < len(result.rounds) / 10, "mostly k = 0, with probes"
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[0] == 2 * PROBE_EVERY and all(b == min(2 * a, PROBE_MAX_GAP) for a, b in zip(gaps, gaps[1:])), gaps
    first, *later = drafter_fleet[0].stub.contexts("Propose")
    assert (first.base_length, list(first.new_tokens)) == (0, PROMPT)
    assert later and max(len(c.new_tokens) for c in later) <= MAX_DRAFTER_BACKLOG
    # The stats say what happened instead of an acceptance rate over a few drafts.
    stats = summarize(result, 1.0, 0, faults)
    assert stats["drafted_rounds"] == len(drafted) and stats["acceptance_rate"] == 0.0
    note = stats["draft_note"]
    assert note.startswith(f"adaptive k (cost policy): drafted in {len(drafted)} of {len(result.rounds)} rounds")
    assert f"{len(probes)} probe rounds" in note and f"acceptance 0.0% over {stats['drafted_tokens']} drafts" in note


def test_a_drafter_far_behind_restarts_from_recent_tokens_instead_of_catching_up(fleets):
    """A drafter that answered nothing for 100 rounds (an outage) comes back: it gets the last RESTART_CONTEXT
    tokens, not the 100-token backlog, and drafting goes on from there with the output unchanged."""
    verifiers, drafters, drafter_fleet = fleets()
    stub = drafter_fleet[0].stub
    back: dict[str, int] = {}

    def outage(tokens: list[int]) -> None:
        down = 4 <= len(tokens) < 104
        if stub.down and not down:
            back.update(call=len(stub.requests), committed=len(tokens))
        stub.down = down
    result, drafter, stats, _ = generate(verifiers, drafters, None, 160, length=DraftLength.fixed(3),
                                         after_round=outage)
    assert result.tokens == target_continuation(PROMPT, 160)
    assert stats.degraded_rounds == 100 and drafter.source.restarts >= 1
    method, request = stub.requests[back["call"]]
    history = PROMPT + result.tokens[:back["committed"]]
    # Back (on a drafter that holds nothing of this session, so the whole context goes): recent tokens only, from
    # the last restart during the outage on, never the prompt and the 100-token backlog.
    sent = list(request.context.new_tokens)
    assert method == "Propose" and request.context.base_length == 0
    assert RESTART_CONTEXT <= len(sent) <= MAX_DRAFTER_BACKLOG and sent == history[-len(sent):]
    after = [request.context for name, request in stub.requests[back["call"] + 1:] if name == "Propose"]
    assert after and all(len(c.new_tokens) <= 4 and c.base_length >= RESTART_CONTEXT for c in after), \
        "then deltas on the restarted context"
    assert all(r.drafted == r.accepted == 3 for r in result.rounds[-10:-1]), "drafting as before the outage"


def test_a_backlog_within_the_window_is_caught_up_and_a_longer_one_skipped(fleets):
    _, drafters, drafter_fleet = fleets()
    session = DegradingDraftSession(drafters, "s1", PROMPT, SamplingParams(), 0, CONFIG, FaultStats())
    session.propose(2)
    history = PROMPT + target_continuation(PROMPT, MAX_DRAFTER_BACKLOG + 30)
    session.update(history[len(PROMPT):len(PROMPT) + MAX_DRAFTER_BACKLOG])
    session.propose(2)
    session.update(history[len(PROMPT) + MAX_DRAFTER_BACKLOG:])
    session.update(target_continuation(history, MAX_DRAFTER_BACKLOG + 1 - 30))
    full = history + target_continuation(history, MAX_DRAFTER_BACKLOG + 1 - 30)
    assert session.propose(2).tokens == tuple(target_continuation(full, 2)), "drafts from recent context alone"
    session.update([7])
    session.propose(1)
    contexts = [(c.base_length, list(c.new_tokens)) for c in drafter_fleet[0].stub.contexts("Propose")]
    assert contexts[1] == (len(PROMPT), history[len(PROMPT):len(PROMPT) + MAX_DRAFTER_BACKLOG]), "64: caught up"
    held = len(PROMPT) + MAX_DRAFTER_BACKLOG
    assert contexts[2] == (held, full[-RESTART_CONTEXT:]), "65: skipped to the last RESTART_CONTEXT after what it held"
    assert contexts[3] == (held + RESTART_CONTEXT, [7]), "then deltas again"
    assert session.restarts == 1
    # What it held stays on the drafter (the worker's prefix cache keeps it for the conversation's next turn).
    assert drafter_fleet[0].stub.sessions["s1"].tokens == [*full[:held], *full[-RESTART_CONTEXT:], 7]


# ---- the summary line and the --json stats ----

def stats_of(loop: LoopResult, degraded_rounds: int = 0) -> dict:
    return {**summarize(loop, 2.0, 0, FaultStats(degraded_rounds=degraded_rounds)), "verifier_engine": "toy"}


def test_the_summary_says_drafting_is_off_and_why(fleets, capsys):
    verifiers, drafters, _ = fleets()
    result, _, _, _ = generate(verifiers, drafters, NOTHING_PAYS, 50)
    stats = stats_of(result)
    assert stats["draft_decision"] == stats["draft_note"] == result.draft_decision
    assert stats["drafted_rounds"] == 0 and stats["acceptance_rate"] is None
    print_summary(SimpleNamespace(finish_reason="length", stats=stats))
    line = capsys.readouterr().err
    assert "drafting off: no draft length pays (c=0.60 of a target step, v(1)=2.20" in line
    assert "best possible 0.71x target-only" in line
    assert "acceptance rate" not in line and "mean accepted length" not in line


def test_the_summary_says_how_little_was_drafted_and_over_how_many_drafts(capsys):
    from coordinator.drafting.rounds import RoundRecord
    rounds = [RoundRecord(4, 0, 0.1, 1.0), *[RoundRecord(0, 0, 0.0, 1.0)] * 7, RoundRecord(1, 1, 0.0, 1.0),
              *[RoundRecord(0, 0, 0.0, 1.0)] * 7]
    loop = LoopResult(tokens=[1] * 17, rounds=rounds, draft_decision="adaptive k (cost policy)", draft_policy="cost")
    stats = stats_of(loop)
    assert stats["draft_note"] == ("adaptive k (cost policy): drafted in 2 of 16 rounds (k = 0 elsewhere: drafts did "
                                   "not pay at the measured acceptance; 1 probe rounds); acceptance 20.0% over 5 "
                                   "drafts")
    print_summary(SimpleNamespace(finish_reason="length", stats=stats))
    line = capsys.readouterr().err
    assert "drafted in 2 of 16 rounds" in line and "acceptance rate" not in line
    # A run that drafted in most rounds keeps the acceptance rate and the mean accepted length.
    busy = LoopResult(tokens=[1] * 10, rounds=[RoundRecord(4, 2, 0.1, 1.0)] * 4, draft_decision="fixed k = 4",
                      draft_policy="fixed")
    stats = stats_of(busy)
    assert stats["draft_note"] is None and stats["draft_decision"] == "fixed k = 4"
    print_summary(SimpleNamespace(finish_reason="length", stats=stats))
    assert "acceptance rate 50.0%; mean accepted length 2.50 tokens/round" in capsys.readouterr().err
    # Rounds without a drafter answering are counted as such.
    degraded = LoopResult(tokens=[1] * 6, rounds=[RoundRecord(2, 1, 0.1, 1.0)] + [RoundRecord(0, 0, 0.0, 1.0)] * 4,
                          draft_decision="fixed k = 2", draft_policy="fixed")
    assert stats_of(degraded, 4)["draft_note"] == ("fixed k = 2: drafted in 1 of 5 rounds (4 rounds without a drafter "
                                                  "answering); acceptance 50.0% over 2 drafts")
    no_drafter = LoopResult(tokens=[1] * 3, rounds=[RoundRecord(0, 0, 0.0, 1.0)] * 3,
                            draft_decision="target-only decoding (no drafter)")
    assert stats_of(no_drafter)["draft_note"] == "target-only decoding (no drafter)"


def test_a_streamed_target_only_baseline_pays_no_round_trip_per_token():
    """Split hosts: with 10 ms round trips, a round of k = 0 costs v(0) + 10 ms, but a generation that never drafts
    is one Decode stream at v(0) per token. Drafting that beats the rounds but not the stream is off."""
    costs = CostEstimate(0.7, draft_s_per_token=0.012, verify_s_base=0.040, verify_s_per_token=0.0,
                         verify_curve=((0, 0.040), (1, 0.062), (4, 0.110), (8, 0.170), (16, 0.300)),
                         draft_round_trip_s=0.010, verify_round_trip_s=0.010)
    assert costs.drafting_off(16) is None, "against rounds that each pay a round trip, drafting can pay"
    streamed = replace(costs, target_streams=True)
    off = streamed.drafting_off(16)
    assert off is not None and off.target_step_s == 0.040
    assert off.plausible_speedup < 1.0 <= costs.at_acceptance(PLAUSIBLE_ACCEPTANCE).tokens_per_s(
        costs.best_k(16)) / costs.at_acceptance(PLAUSIBLE_ACCEPTANCE).tokens_per_s(0)


def test_stretches_without_drafts_are_streamed_and_probes_keep_their_schedule(fleets):
    """Between probes the policy drafts nothing: each such stretch is one Decode stream of exactly its rounds, the
    probes are Verify rounds, and the output is the target's."""
    verifiers, drafters, _ = fleets(draft_error_at=0)
    result, _, _, _ = generate(verifiers, drafters, DRAFTING_PAYS, 300)
    assert result.tokens == target_continuation(PROMPT, 300)
    stretches, run = [], 0
    for r in result.rounds:
        if r.drafted:
            stretches, run = stretches + ([run] if run else []), 0
        else:
            run += 1
    stretches += [run] if run else []
    requests = verifiers.endpoints[0].stub.requests
    assert [r.max_tokens for method, r in requests if method == "Decode"] == stretches
    assert sum(method == "Verify" for method, _ in requests) == sum(1 for r in result.rounds if r.drafted)
    assert len(stretches) >= 4 and max(stretches) >= 64


def test_greedy_rounds_that_run_slower_than_the_workers_costs_say_turn_drafting_off():
    """The prior says drafting pays at the run's acceptance; this generation's drafted rounds took 1.5x what it
    prices them at (drafter and verifier sharing cores), its rounds without drafts what it says. A greedy generation
    corrects the prior by that and stops drafting; a sampled one (timed=False) keeps the prior: its k must not
    depend on timing."""
    from coordinator.drafting.rounds import RoundRecord
    from coordinator.drafting.estimators import measured_drafting_slowdown
    prior = CostEstimate(PRIOR_ACCEPTANCE, 0.4, 1.0, 0.0, verify_curve=((0, 1.0), (1, 1.25), (4, 2.2), (16, 7.0)))
    length = DraftLength(policy="cost", prior=prior)
    assert prior.could_pay(16, 0.8) and not replace(prior, drafting_slowdown=1.5).could_pay(16, 0.8)

    def drafted(k: int, accepted: int, slowdown: float) -> RoundRecord:
        return RoundRecord(k, accepted, slowdown * k * 0.4, slowdown * prior.verify_s(k))
    rounds = [RoundRecord(0, 0, 0.0, 5.0), *[RoundRecord(0, 0, 0.0, 1.0)] * 4,
              *[drafted(2, 1, 1.5), drafted(3, 3, 1.5)] * 4]
    assert measured_drafting_slowdown(rounds, prior) == pytest.approx(1.5)
    assert measured_drafting_slowdown(rounds[:6], prior) == 1.0, "too few drafted rounds to tell"
    assert replace(length, timed=True).next(3, rounds) == 0
    assert replace(length, timed=False).next(3, rounds) > 0


def test_a_measured_slowdown_carries_to_the_next_greedy_generations_and_fades_with_requests():
    """What one greedy generation measured (drafted rounds 1.5x slower than the workers' costs) starts the next:
    with it drafting is off from the first round, so the probes are paid once. It fades with every generation that
    does not measure it again, so that a few requests later drafting is tried again (the probe), and it is
    forgotten after FORGET_AFTER_REQUESTS. Sampled generations keep the prior."""
    from coordinator.api import Coordinator, GenerationOptions
    from coordinator.drafting.learned import FORGET_AFTER_REQUESTS, SourceLearning
    from coordinator.drafting.rounds import RoundRecord
    prior = CostEstimate(PRIOR_ACCEPTANCE, 0.4, 1.0, 0.0, verify_curve=((0, 1.0), (1, 1.25), (4, 2.2), (16, 7.0)),
                         target_streams=True)
    rounds = [RoundRecord(0, 0, 0.0, 5.0), *[RoundRecord(0, 0, 0.0, 1.0)] * 4,
              *[RoundRecord(k, a, 1.5 * k * 0.4, 1.5 * prior.verify_s(k)) for k, a in [(2, 1), (3, 3)] * 4]]
    coordinator = SimpleNamespace(cost_prior=prior, learning=SourceLearning(), draft_limit=16, propose_limit=16,
                                  drafters=object(), suffix_drafters=None)
    greedy, sampled = GenerationOptions(), GenerationOptions(temperature=0.8)
    first = Coordinator.draft_length(coordinator, greedy, coordinator.learning.start_generation())
    assert first.drafting_off() is None and first.timed
    Coordinator._learn(coordinator, first, LoopResult(rounds=rounds), None)
    assert coordinator.learning.get("").value == pytest.approx(1.5)
    off = Coordinator.draft_length(coordinator, greedy, coordinator.learning.start_generation()).drafting_off()
    assert off is not None and "1.50x slower than the workers' costs" in str(off)
    assert Coordinator.draft_length(coordinator, sampled, {}).drafting_off() is None
    # Generations that drafted nothing (drafting off) measured nothing: the slowdown fades until drafting is on
    # again, well before it is forgotten.
    decisions = [Coordinator.draft_length(coordinator, greedy, coordinator.learning.start_generation()).drafting_off()
                 for _ in range(FORGET_AFTER_REQUESTS)]
    assert decisions[-1] is None and decisions.index(None) <= 2, decisions
    assert coordinator.learning.start_generation() == {}, "forgotten after FORGET_AFTER_REQUESTS generations"


# The real pair on ik, 2 shared cores (issue 38's log): a suffix drafter's drafts cost nothing, the draft model's
# 0.45 target steps a token, and the verify curve flat to a few drafts, then steeper.
IK_CURVE = ((0, 1.0), (1, 1.15), (2, 1.2), (4, 1.3), (9, 2.1), (16, 3.6))
SUFFIX_PRIOR = CostEstimate(PRIOR_ACCEPTANCE, 0.0, 1.0, 0.0, verify_curve=IK_CURVE, target_streams=True)
MODEL_PRIOR = CostEstimate(PRIOR_ACCEPTANCE, 0.45, 1.0, 0.0, verify_curve=IK_CURVE, target_streams=True)


def test_a_slow_draft_model_never_locks_the_suffix_drafter_out():
    """Issue 38's lock-out: one generation whose model-drafted rounds ran 3.28x slower than the workers' costs made
    every later request decode target-only for ten minutes, the free suffix drafts included. Scripted here: the
    first generation's model rounds take 3.28x their price (and the round records say so); then a run of repeating
    requests. Every one of them must be able to draft from the suffix drafter (c < 0.1), and the draft model, ruled
    out by what it measured (its overhead a round, held as measured), must be tried again once that is forgotten,
    after FORGET_AFTER_REQUESTS requests."""
    from coordinator.api import Coordinator, GenerationOptions
    from coordinator.drafting.hybrid import HybridDraftSource
    from coordinator.drafting.learned import FORGET_AFTER_REQUESTS, SourceLearning
    from coordinator.drafting.rounds import RoundRecord
    from coordinator.fleet.drafter_prefixes import DrafterPrefixes
    from coordinator.loop import Draft

    coordinator = SimpleNamespace(cost_prior=SUFFIX_PRIOR, model_costs=MODEL_PRIOR, learning=SourceLearning(),
                                  draft_limit=16, propose_limit=16, drafters=object(), suffix_drafters=object(),
                                  translator=None, drafter_prefixes=DrafterPrefixes())
    greedy = GenerationOptions()

    def start():
        learned = coordinator.learning.start_generation()
        length = Coordinator.draft_length(coordinator, greedy, learned)
        hybrid = Coordinator._draft_source(coordinator, "s", [1, 2, 3], greedy, 0, None, None, learned)
        return length, hybrid

    length, _ = start()
    assert length.drafting_off() is None and length.source == "suffix"
    # The first generation: nothing to match yet, so the draft model drafts, each Propose 3.28x its price.
    now = [0.0]

    asked = []

    class SlowModel:
        def propose(self, k, after=()):
            asked.append(k)
            now[0] += 3.28 * k * MODEL_PRIOR.draft_s_per_token
            return Draft((7,) * k)

        def update(self, committed):
            pass

    class NoMatch:
        def propose(self, k, after=()):
            return Draft()

        def update(self, committed):
            pass
    hybrid = HybridDraftSource(NoMatch(), SlowModel(), model_costs=MODEL_PRIOR, clock=lambda: now[0])
    rounds = [RoundRecord(0, 0, 0.0, 5.0)]
    for _ in range(6):
        draft = hybrid.propose(4)
        if draft.tokens:  # each verify takes what its costs say
            now[0] += MODEL_PRIOR.verify_round_trip_s + MODEL_PRIOR.verify_s(len(draft.tokens))
            hybrid.update([*draft.tokens[:2], 9])
            rounds.append(RoundRecord(len(draft.tokens), 2, 3.28 * len(draft.tokens) * 0.45,
                                      MODEL_PRIOR.verify_s(len(draft.tokens)), source="model"))
    rounds += [RoundRecord(0, 0, 0.0, 1.0)] * 4
    # Measured as seconds a round beyond the price (the opening round, with its prefill, aside)
    overhead = statistics.median_low(2.28 * k * MODEL_PRIOR.draft_s_per_token for k in asked[1:])
    assert hybrid.model_overhead_s() == pytest.approx(overhead) and overhead > 1.0
    Coordinator._learn(coordinator, length, LoopResult(rounds=rounds), hybrid)
    assert coordinator.learning.get("model").value == pytest.approx(overhead)
    assert coordinator.learning.get("suffix") is None, "the model's rounds say nothing of the suffix drafter's costs"
    # The repeating requests: drafting is never off, so the suffix drafter drafts in every one of them.
    models = []
    for _ in range(8):
        length, hybrid = start()
        assert length.drafting_off() is None
        assert length.first() > 0 or length.next(0, [RoundRecord(0, 0, 0.0, 1.0)]) > 0
        models.append(hybrid.model is not None)
    assert not models[0], "the model, measured over a target step slower a round, sits the next request out"
    assert not any(models[:FORGET_AFTER_REQUESTS]) and models[FORGET_AFTER_REQUESTS], \
        f"... held out while its overhead is held, and tried again once that is forgotten: {models}"


def test_a_model_session_s_opening_is_priced_from_the_drafter_s_costs_then_from_what_openings_measured():
    """What prefilling a token costs the draft model where its session opens (the hybrid's opening gate): a third of
    a drafted token's cost until an opening of 32 tokens or more measured it; then, for the next generations, what
    it measured, as a factor over that prior that fades with the generations that did not measure it again."""
    from coordinator.api import MODEL_OPENING, OPENING_TOKEN_SHARE, Coordinator, opening_s_per_token
    from coordinator.drafting.hybrid import HybridDraftSource
    from coordinator.drafting.learned import SourceLearning
    from tests.coordinator.drafting.test_hybrid import Scripted

    assert opening_s_per_token(None, {}) is None
    assert opening_s_per_token(MODEL_PRIOR, None) == pytest.approx(MODEL_PRIOR.draft_s_per_token * OPENING_TOKEN_SHARE)
    assert opening_s_per_token(MODEL_PRIOR, {MODEL_OPENING: 2.0}) == pytest.approx(
        2 * MODEL_PRIOR.draft_s_per_token * OPENING_TOKEN_SHARE)
    coordinator = SimpleNamespace(model_costs=MODEL_PRIOR, learning=SourceLearning())
    hybrid = HybridDraftSource(Scripted([]), Scripted([]), model_costs=MODEL_PRIOR)
    length = SimpleNamespace(measured_slowdown=lambda rounds: None, source="suffix")
    Coordinator._learn(coordinator, length, LoopResult(), hybrid)
    assert coordinator.learning.get(MODEL_OPENING) is None, "no opening measured, nothing learned"
    hybrid.opening_measured_s_per_token = 3 * MODEL_PRIOR.draft_s_per_token * OPENING_TOKEN_SHARE
    Coordinator._learn(coordinator, length, LoopResult(), hybrid)
    learned = coordinator.learning.start_generation()
    assert learned[MODEL_OPENING] == pytest.approx(3.0)
    assert opening_s_per_token(MODEL_PRIOR, learned) == pytest.approx(hybrid.opening_measured_s_per_token)
    assert coordinator.learning.start_generation()[MODEL_OPENING] == pytest.approx(2.0), "fading towards the prior"


def test_what_a_hybrid_s_streamed_tokens_took_prices_target_only_decoding_in_the_next_generations():
    """The tokens a hybrid streams without drafts are what the draft model's rounds compete with: what they took,
    against the verifier's v(0), is learned (a factor, fading like the others), and the next generation prices
    target-only decoding with it from its first round, before its own stretches measure it. Where streaming is far
    cheaper than the probe's v(0) said, the draft model is left out from the start."""
    from coordinator.api import STREAMED, Coordinator, GenerationOptions
    from coordinator.drafting.hybrid import HybridDraftSource
    from coordinator.drafting.learned import SourceLearning
    from coordinator.fleet.drafter_prefixes import DrafterPrefixes
    from tests.coordinator.drafting.test_hybrid import Scripted

    coordinator = SimpleNamespace(cost_prior=SUFFIX_PRIOR, model_costs=MODEL_PRIOR, learning=SourceLearning(),
                                  draft_limit=16, propose_limit=16, drafters=object(), suffix_drafters=object(),
                                  translator=None, drafter_prefixes=DrafterPrefixes())
    greedy = GenerationOptions()

    def start() -> tuple[DraftLength, HybridDraftSource]:
        learned = coordinator.learning.start_generation()
        return (Coordinator.draft_length(coordinator, greedy, learned),
                Coordinator._draft_source(coordinator, "s", [1, 2, 3], greedy, 0, None, None, learned))

    length, first = start()
    assert first.model is not None and first.model_costs.streamed_token_s is None
    now = [0.0]
    streaming = HybridDraftSource(Scripted([]), None, model_costs=MODEL_PRIOR, clock=lambda: now[0])
    for _ in range(4):  # stretches without drafts, each token at 0.4 of the verifier's v(0)
        draft = streaming.propose(4)
        now[0] += 0.4 * MODEL_PRIOR.verify_s(0) * draft.wait_tokens
        streaming.update([5] * draft.wait_tokens)
    assert streaming.streamed_token_s() == pytest.approx(0.4 * MODEL_PRIOR.verify_s(0))
    Coordinator._learn(coordinator, length, LoopResult(), streaming)
    assert coordinator.learning.get(STREAMED).value == pytest.approx(0.4)
    _, second = start()
    assert second.model is None, "a model round priced against 0.4 of a step a token cannot pay: its session unopened"
    assert coordinator.learning.get(STREAMED).requests_since == 1
    coordinator.learning.record(STREAMED, 0.9, STREAMED_MEASURE)
    _, third = start()
    assert third.model is not None and third.model_costs.streamed_token_s == pytest.approx(0.9 * MODEL_PRIOR.verify_s(0))
    assert third.priced_model().target_only_s() == pytest.approx(0.9 * MODEL_PRIOR.verify_s(0))


def test_the_summary_says_where_the_model_s_session_never_opened_because_it_could_not_pay(capsys):
    from coordinator.drafting.rounds import RoundRecord
    loop = LoopResult(tokens=[1] * 8, rounds=[RoundRecord(3, 3, 0.0, 1.0), *[RoundRecord(0, 0, 0.0, 1.0)] * 4],
                      draft_decision="adaptive k (cost policy)", draft_policy="cost")
    for declined, model_rounds, said in ((5, 0, True), (2, 4, False), (0, 0, False)):
        stats = {**stats_of(loop), "suffix_rounds": 1, "model_rounds": model_rounds,
                 "model_openings_declined": declined}
        print_summary(SimpleNamespace(finish_reason="length", stats=stats))
        line = capsys.readouterr().err
        assert f"the draft model in {model_rounds}" in line
        assert ("its session's opening could not pay" in line) is said, line
