"""The coordinator's failover and degradation state machine (coordinator/fleet/remote_sessions.py) against fake workers:
retries, failover with the full history, breakers, resyncs, degraded rounds and recovery. No servers, no models:
every test runs in well under a second or two."""

from __future__ import annotations

import time
from dataclasses import replace

import grpc
import pytest

from coordinator.drafting.policies import DraftLength
from coordinator.fleet.pools import WorkerPool
from coordinator.loop import Draft, LoopConfig, speculative_decode
from coordinator.fleet.polling import wait_until
from coordinator.fleet.remote_sessions import DegradingDraftSession, FailoverTargetSession, FaultStats
from coordinator.fleet.resilience import NoWorkerAvailable, ResilienceConfig
from specmesh.decoding.sampling import SamplingParams
from tests.coordinator.fleet.fake_workers import FakeFleet, FakeRpcError, Fault, target_continuation

PROMPT = [3, 14, 15, 9, 26]
# Fast backoff; a breaker that opens after two failures and, unless a test shortens it, stays open throughout.
FAST = ResilienceConfig(verify_timeout_s=1.0, propose_timeout_s=1.0, retry_budget_s=3.0, backoff_initial_s=0.001,
                        backoff_max_s=0.01, breaker_fail_max=2, breaker_reset_s=60.0)
UNAVAILABLE, DEADLINE, INVALID = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                  grpc.StatusCode.INVALID_ARGUMENT)


@pytest.fixture
def make_pool():
    """make_pool(role, count, config=FAST, **fake_options) -> (WorkerPool over fakes, FakeFleet), every endpoint
    SERVING; all closed at the end."""
    pools: list[WorkerPool] = []

    def make(role: str, count: int, config: ResilienceConfig = FAST, **options) -> tuple[WorkerPool, FakeFleet]:
        fleet = FakeFleet(role, count, **options)
        pool = WorkerPool(fleet.addresses, role, config, connect=fleet.connect)
        pools.append(pool)
        assert wait_until(lambda: all(e.serving for e in pool.endpoints), 5.0), "fake health never said SERVING"
        return pool, fleet

    yield make
    for pool in pools:
        pool.close()


def verifier_session(pool: WorkerPool, config: ResilienceConfig = FAST) -> FailoverTargetSession:
    return FailoverTargetSession(pool, "s1", PROMPT, SamplingParams(), 0, config, FaultStats())


def drafter_session(pool: WorkerPool, stats: FaultStats, config: ResilienceConfig = FAST) -> DegradingDraftSession:
    return DegradingDraftSession(pool, "s1", PROMPT, SamplingParams(), 0, config, stats)


def decode(drafter, target, max_new_tokens: int = 24, k: int = 3, after_round=None, stream: bool = True,
           flush_s: float = 0.0):
    """Run the real loop; `after_round(tokens so far)` runs after each round's tokens are committed. `stream`: without
    a drafter, target-only decoding is one Decode stream (else a Verify per token); `flush_s`: its flush interval."""
    seen: list[int] = []

    def on_tokens(new: list[int]) -> bool:
        seen.extend(new)
        if after_round is not None:
            after_round(seen)
        return False
    return speculative_decode(drafter, target, LoopConfig(max_new_tokens, draft_length=DraftLength.fixed(k),
                                                          stream_target_only=stream, stream_flush_s=flush_s),
                              on_tokens=on_tokens)


def pinned_index(pool: WorkerPool) -> int:
    return next(i for i, e in enumerate(pool.endpoints) if e.sessions > 0)


def test_verify_sends_the_prompt_once_then_only_what_is_new(make_pool):
    pool, fleet = make_pool("verifier", 1)
    target = verifier_session(pool)
    first = target.verify(Draft(tuple(target_continuation(PROMPT, 3))))
    second = target.verify(Draft((0, 0)))  # wrong drafts: the target's own token only
    assert (first.accepted, second.accepted) == (3, 0)
    contexts = fleet[0].stub.contexts("Verify")
    assert [list(c.new_tokens) for c in contexts] == [PROMPT, []]
    assert contexts[1].base_length == len(PROMPT) + 4
    assert target.link.sync.history.tokens == PROMPT + target_continuation(PROMPT, 5)
    assert target.stats.as_dict() == {"retries": 0, "failovers": 0, "degraded_rounds": 0, "resyncs": 0}


def test_a_failing_verifier_is_retried_then_left_for_the_next_with_the_full_history(make_pool):
    verifiers, fleet = make_pool("verifier", 2)
    drafters, _ = make_pool("drafter", 1, draft_error_at=2)  # every third draft wrong: rounds of all kinds
    stats = FaultStats()
    target = FailoverTargetSession(verifiers, "s1", PROMPT, SamplingParams(), 0, FAST, stats)
    broken = []

    def break_pinned(tokens: list[int]) -> None:
        if not broken and len(tokens) >= 6:
            broken.append(pinned_index(verifiers))
            fleet[broken[0]].stub.down = True  # calls fail, though its health still says SERVING
    result = decode(drafter_session(drafters, stats), target, after_round=break_pinned)

    assert result.tokens == target_continuation(PROMPT, 24), "failover must not change the output"
    assert stats.retries == 1 and stats.failovers == 1 and stats.degraded_rounds == 0
    survivor = fleet[1 - broken[0]].stub.contexts("Verify")[0]
    assert survivor.base_length == 0 and len(survivor.new_tokens) > len(PROMPT), "the full history, prompt and all"
    assert verifiers.endpoints[broken[0]].sessions == 0 and verifiers.endpoints[1 - broken[0]].sessions == 1
    assert verifiers.endpoints[broken[0]].breaker.breaker.fail_counter == 1
    target.end()
    assert [w.stub.ended for w in fleet.workers.values()] == [["s1"], ["s1"]], "both verifiers held the session"
    assert all(e.sessions == 0 for e in verifiers.endpoints)


def test_a_lost_reply_is_retried_on_the_same_verifier_which_rolls_back_its_commit(make_pool):
    pool, fleet = make_pool("verifier", 1)
    target = verifier_session(pool)
    target.verify(Draft())
    stub = fleet[0].stub
    stub.faults.append(Fault(DEADLINE, "deadline passed", after_serving=True))  # served, but the reply is lost
    verdict = target.verify(Draft(tuple(target_continuation(PROMPT, 3)[1:])))
    assert verdict.accepted == 2
    failed, retried = stub.contexts("Verify")[1:]
    assert failed == retried, "the retry builds on the same prefix: the server drops what the lost call committed"
    assert target.stats.retries == 1 and target.stats.failovers == 0 and target.stats.resyncs == 0
    assert target.link.sync.history.tokens == PROMPT + target_continuation(PROMPT, 4)


@pytest.mark.parametrize("stream", [False, True], ids=["verify-rounds", "decode-stream"])
def test_a_restarted_verifier_asks_for_a_resync_and_gets_the_full_history(make_pool, stream):
    pool, fleet = make_pool("verifier", 1)
    target = verifier_session(pool)
    result = decode(None, target, max_new_tokens=6, stream=stream,
                    after_round=lambda tokens: len(tokens) == 3 and fleet[0].restart())
    assert result.tokens == target_continuation(PROMPT, 6)
    assert target.stats.resyncs == 1 and target.stats.retries == 0
    if stream:  # one stream; the next step after the restart finds no session: re-opened with the full history
        first, resent = fleet[0].stub.contexts("Decode")
        assert first.base_length == 0 and list(first.new_tokens) == PROMPT
    else:
        refused, resent = fleet[0].stub.contexts("Verify")[3:5]
        assert refused.base_length == len(PROMPT) + 3 and list(refused.new_tokens) == []
    assert resent.base_length == 0 and list(resent.new_tokens) == PROMPT + target_continuation(PROMPT, 3)


def test_consecutive_failures_open_the_breaker_and_a_probe_closes_it(make_pool):
    config = ResilienceConfig(retry_budget_s=5.0, backoff_initial_s=0.001, backoff_max_s=0.01, breaker_fail_max=2,
                              breaker_reset_s=0.2)
    pool, fleet = make_pool("verifier", 1, config)
    fleet[0].stub.faults.extend([Fault(UNAVAILABLE), Fault(UNAVAILABLE)])
    target = verifier_session(pool, config)
    started = time.monotonic()
    verdict = target.verify(Draft())
    # Two failures open the breaker; nothing may be called until it half-opens, and then the probe succeeds.
    assert time.monotonic() - started >= 0.2
    assert verdict.next_token == target_continuation(PROMPT, 1)[0]
    assert len(fleet[0].stub.requests) == 3, "no call while the breaker was open"
    assert target.stats.retries > 3, "waiting for the breaker counts as retries"
    name = f"verifier@{fleet.addresses[0]}"
    assert pool.transitions.counts == {(name, "closed", "open"): 1, (name, "open", "half-open"): 1,
                                       (name, "half-open", "closed"): 1}


def test_a_bad_request_is_neither_retried_nor_held_against_the_verifier(make_pool):
    pool, fleet = make_pool("verifier", 2)
    fleet[0].stub.faults.append(Fault(INVALID, "draft_tokens: too many"))
    target = verifier_session(pool)
    with pytest.raises(FakeRpcError) as error:
        target.verify(Draft())
    assert error.value.code() == INVALID
    assert target.stats.retries == 0 and target.stats.failovers == 0
    assert pool.endpoints[0].breaker.breaker.fail_counter == 0 and pool.endpoints[0].usable()


def test_no_verifier_left_raises_no_worker_available(make_pool):
    config = ResilienceConfig(retry_budget_s=0.3, backoff_initial_s=0.001, backoff_max_s=0.01)
    pool, fleet = make_pool("verifier", 2, config)
    target = verifier_session(pool, config)
    target.verify(Draft())
    for worker in fleet.workers.values():
        worker.kill()
    assert wait_until(lambda: not any(e.serving for e in pool.endpoints), 5.0)
    with pytest.raises(NoWorkerAvailable, match="no verifier is serving"):
        target.verify(Draft())
    assert target.stats.retries >= 1 and target.stats.failovers == 0
    assert all(len(w.stub.requests) == 1 for w in fleet.workers.values() if w.stub.requests), \
        "no call goes to a worker whose health says NOT_SERVING"


def test_a_drafter_error_degrades_the_round_and_drafting_resumes_after_the_probe(make_pool):
    config = ResilienceConfig(backoff_initial_s=0.001, backoff_max_s=0.01, breaker_fail_max=1, breaker_reset_s=0.2)
    pool, fleet = make_pool("drafter", 1, config)
    stats = FaultStats()
    drafter = drafter_session(pool, stats, config)
    assert drafter.propose(3).tokens == tuple(target_continuation(PROMPT, 3))
    stub = fleet[0].stub
    stub.faults.append(Fault(UNAVAILABLE))
    assert drafter.propose(3) == Draft(), "a failed drafter call: this round decodes without drafts"
    assert stats.degraded_rounds == 1 and drafter.link.endpoint is None and pool.endpoints[0].sessions == 0
    calls = len(stub.requests)
    assert drafter.propose(3) == Draft(), "breaker open: not even tried"
    assert stats.degraded_rounds == 2 and len(stub.requests) == calls
    assert wait_until(pool.endpoints[0].breaker.allows_call, 5.0)
    assert drafter.propose(3).tokens == tuple(target_continuation(PROMPT, 3)), "the half-open probe drafts again"
    assert stub.contexts("Propose")[-1].base_length == 0, "back on a drafter: the full history"
    assert pool.endpoints[0].breaker.state == "closed" and stats.degraded_rounds == 2 and stats.retries == 0


def test_degraded_rounds_keep_the_output_of_plain_target_decoding(make_pool):
    config = replace(FAST, breaker_fail_max=3)  # two failures in a row leave the drafter's breaker closed
    verifiers, _ = make_pool("verifier", 1, config)
    drafters, drafter_fleet = make_pool("drafter", 1, config, draft_error_at=1)
    drafter_fleet[0].stub.faults.extend([None, Fault(UNAVAILABLE), Fault(DEADLINE), None])
    stats = FaultStats()
    target = FailoverTargetSession(verifiers, "s1", PROMPT, SamplingParams(), 0, config, stats)
    result = decode(drafter_session(drafters, stats, config), target, max_new_tokens=16)
    assert result.tokens == target_continuation(PROMPT, 16)
    assert stats.degraded_rounds == 2 and [r.drafted for r in result.rounds][1:3] == [0, 0]
    assert result.rounds[3].drafted == 3, "the drafter is used again once it answers"


def test_a_bad_request_degrades_the_round_without_opening_the_drafters_breaker(make_pool):
    config = ResilienceConfig(breaker_fail_max=1)
    pool, fleet = make_pool("drafter", 1, config)
    fleet[0].stub.faults.append(Fault(INVALID, "num_tokens above max_draft_tokens"))
    stats = FaultStats()
    drafter = drafter_session(pool, stats, config)
    assert drafter.propose(40) == Draft() and stats.degraded_rounds == 1
    assert pool.endpoints[0].breaker.state == "closed" and drafter.propose(3).tokens


def test_a_restarted_drafter_gets_the_full_history_on_resync(make_pool):
    pool, fleet = make_pool("drafter", 1)
    stats = FaultStats()
    drafter = drafter_session(pool, stats)
    drafter.propose(2)
    committed = target_continuation(PROMPT, 2)
    drafter.update(committed)
    fleet[0].restart()
    assert drafter.propose(2).tokens == tuple(target_continuation(PROMPT + committed, 2))
    assert stats.resyncs == 1 and stats.degraded_rounds == 0
    first, refused, resent = fleet[0].stub.contexts("Propose")
    assert (refused.base_length, list(refused.new_tokens)) == (len(PROMPT), committed)
    assert (resent.base_length, list(resent.new_tokens)) == (0, PROMPT + committed)


def test_drafting_past_uncommitted_tokens_does_not_commit_them(make_pool):
    pool, fleet = make_pool("drafter", 1)
    drafter = drafter_session(pool, FaultStats())
    guess = target_continuation(PROMPT, 2)
    assert drafter.propose(2, after=guess).tokens == tuple(target_continuation(PROMPT, 4)[2:])
    drafter.update([guess[0], 0])  # the target accepted one of them, then chose its own token
    drafter.propose(1)
    bet, next_call = fleet[0].stub.contexts("Propose")
    assert list(bet.new_tokens) == PROMPT + guess
    assert next_call.base_length == len(PROMPT) and list(next_call.new_tokens) == [guess[0], 0]


# Target-only decoding as one Decode stream (no drafter, or drafting off).

def test_a_stream_sends_the_prompt_once_and_gives_the_target_output(make_pool):
    pool, fleet = make_pool("verifier", 1)
    target = verifier_session(pool)
    result = decode(None, target, max_new_tokens=8)
    assert result.tokens == target_continuation(PROMPT, 8) and result.finish_reason == "length"
    assert len(result.rounds) == 8 and all(r.drafted == 0 for r in result.rounds)
    (context,) = fleet[0].stub.contexts("Decode")
    assert list(context.new_tokens) == PROMPT and fleet[0].stub.contexts("Verify") == []
    assert target.link.sync.history.tokens == PROMPT + target_continuation(PROMPT, 8)
    assert target.link.sync.server_length == len(PROMPT) + 8
    assert target.stats.as_dict() == {"retries": 0, "failovers": 0, "degraded_rounds": 0, "resyncs": 0}


def test_a_stop_ends_the_stream_and_the_next_call_cuts_off_what_the_server_ran_ahead(make_pool):
    pool, fleet = make_pool("verifier", 1)
    target = verifier_session(pool)
    seen = []

    def stop_after_three(new: list[int]) -> bool:
        seen.extend(new)
        return len(seen) == 3
    result = speculative_decode(None, target, LoopConfig(20), on_tokens=stop_after_three)
    assert result.tokens == target_continuation(PROMPT, 3) and result.finish_reason == "stop"
    stream_request = fleet[0].stub.requests[-1][1]
    assert stream_request.max_tokens == 20
    fleet[0].stub.sessions["s1"].extend([0, 0])  # the server decoded on before it saw the cancel
    assert target.verify(Draft()).next_token == target_continuation(PROMPT, 4)[-1]
    assert fleet[0].stub.contexts("Verify")[0].base_length == len(PROMPT) + 3, "built on the client's own length"


def test_an_end_of_sequence_token_ends_the_stream(make_pool):
    pool, fleet = make_pool("verifier", 1)
    eos = target_continuation(PROMPT, 4)[-1]
    result = speculative_decode(None, verifier_session(pool), LoopConfig(20, eos_token_ids=frozenset({eos})))
    assert result.tokens == target_continuation(PROMPT, 4) and result.finish_reason == "eos"
    assert list(fleet[0].stub.requests[-1][1].stop_token_ids) == [eos]


def test_tokens_held_by_the_verifier_are_committed_and_timed_as_one_round_each(make_pool):
    """Messages of several tokens (a flush interval): the same output, one round per token sharing the message's
    wait, and a stop inside a message commits the whole message, as a round of accepted drafts would."""
    pool, fleet = make_pool("verifier", 1)
    result = decode(None, verifier_session(pool), max_new_tokens=8, flush_s=0.1)
    assert result.tokens == target_continuation(PROMPT, 8) and len(result.rounds) == 8
    assert fleet[0].stub.requests[-1][1].flush_interval_ms == 100
    assert result.rounds[1].verify_s == result.rounds[2].verify_s == result.rounds[3].verify_s  # the 2nd message
    target, seen = verifier_session(pool), []

    def stop_at_the_fifth(new: list[int]) -> bool:
        seen.extend(new)
        return len(seen) >= 5
    stopped = speculative_decode(None, target, LoopConfig(20, stream_flush_s=0.1), on_tokens=stop_at_the_fifth)
    assert stopped.tokens == target_continuation(PROMPT, 7) and stopped.finish_reason == "stop"
    assert target.verify(Draft()).next_token == target_continuation(PROMPT, 8)[-1]


@pytest.mark.parametrize("flush_s", [0.0, 0.1], ids=["one token a message", "held tokens"])
def test_a_verifier_killed_mid_stream_is_left_for_the_next_with_the_full_history(make_pool, flush_s):
    verifiers, fleet = make_pool("verifier", 2)
    target = verifier_session(verifiers)
    killed = []

    def kill_pinned(tokens: list[int]) -> None:
        if not killed and len(tokens) == 4:
            killed.append(pinned_index(verifiers))
            fleet[killed[0]].stub.down = True
    result = decode(None, target, max_new_tokens=12, after_round=kill_pinned, flush_s=flush_s)
    assert result.tokens == target_continuation(PROMPT, 12), "failover must not change the output"
    assert target.stats.failovers == 1 and target.stats.retries == 1
    (resumed,) = [request for method, request in fleet[1 - killed[0]].stub.requests if method == "Decode"]
    assert resumed.context.base_length == 0
    assert list(resumed.context.new_tokens) == PROMPT + target_continuation(PROMPT, 4)
    assert resumed.max_tokens == 8, "only what is left"
    assert verifiers.endpoints[killed[0]].breaker.breaker.fail_counter == 1


def test_a_hung_stream_is_cancelled_after_the_step_deadline_and_continued_elsewhere(make_pool):
    config = replace(FAST, verify_timeout_s=0.3)
    verifiers, fleet = make_pool("verifier", 2, config)
    target = verifier_session(verifiers, config)
    target.link.attach()
    hung = pinned_index(verifiers)
    fleet[hung].stub.hang_decode_after = 4
    started = time.monotonic()
    result = decode(None, target, max_new_tokens=10)
    assert result.tokens == target_continuation(PROMPT, 10)
    assert time.monotonic() - started < 3.0, "left after about one step deadline, not a whole stream's"
    assert target.stats.failovers == 1 and target.stats.retries == 1
    assert fleet[1 - hung].stub.requests[-1][1].max_tokens == 6


def test_a_verifier_without_decode_gets_verify_rounds(make_pool):
    pool, fleet = make_pool("verifier", 1)
    fleet[0].stub.decode_unimplemented = True
    target = verifier_session(pool)
    result = decode(None, target, max_new_tokens=5)
    assert result.tokens == target_continuation(PROMPT, 5)
    assert len(fleet[0].stub.contexts("Verify")) == 5
