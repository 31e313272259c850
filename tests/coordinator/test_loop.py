"""The accept/reject loop without gRPC: in-process engine-backed sessions, and the pieces around it."""

from __future__ import annotations

import pytest

from coordinator.loop import Draft, DraftLength, LoopConfig, RoundRecord, speculative_decode
from drafter.engine import DraftEngine
from specmesh.wire.history import TokenHistory
from specmesh.decoding.sampling import SamplingParams
from specmesh.runtime.engine import as_engine
from specmesh.worker.session_store import SessionLimits, SessionStore, kv_sessions
from tests.helpers import reference_greedy
from verifier.engine import VerifyEngine

PARAMS = SamplingParams()


class InProcessDrafter:
    """DraftSource over a DraftEngine, syncing like the remote client does (deltas after the first call)."""

    def __init__(self, engine: DraftEngine, prompt: list[int], params: SamplingParams = PARAMS, seed: int = 0) -> None:
        self.engine, self.history, self.sent, self.requested = engine, TokenHistory(prompt), 0, []
        self.params, self.seed, self.ahead_calls = params, seed, 0

    def propose(self, k: int, after=()) -> Draft:
        if after:
            self.ahead_calls += 1
        else:
            self.requested.append(k)
        p = self.engine.propose("s", self.sent, self.history.hash_at(self.sent),
                                [*self.history.tokens[self.sent:], *after], k, self.params, self.seed)
        self.sent = len(self.history)
        return Draft(p.tokens, p.dists)

    def update(self, committed) -> None:
        self.history.extend(committed)


class InProcessTarget:
    def __init__(self, engine: VerifyEngine, prompt: list[int], params: SamplingParams = PARAMS, seed: int = 0) -> None:
        self.engine, self.history, self.sent = engine, TokenHistory(prompt), 0
        self.params, self.seed = params, seed

    def verify(self, draft: Draft):
        out = self.engine.verify("s", self.sent, self.history.hash_at(self.sent), self.history.tokens[self.sent:],
                                 list(draft.tokens), list(draft.dists), self.params, self.seed)
        self.history.extend([*draft.tokens[:out.verdict.accepted], out.verdict.next_token])
        self.sent = len(self.history)
        return out.verdict


@pytest.fixture(scope="module")
def prompt(tiny_target):
    return tiny_target.tokenizer("for i in range(10):")["input_ids"]


def greedy_loop(target, draft, prompt, **config):
    """(reference greedy tokens, drafter, loop result) for 30 new tokens of `draft` drafting for `target`."""
    expected = reference_greedy(target.model, prompt, 30, set(target.eos_token_ids))
    drafter = InProcessDrafter(DraftEngine(draft), prompt)
    result = speculative_decode(drafter, InProcessTarget(VerifyEngine(target), prompt),
                                LoopConfig(max_new_tokens=30, eos_token_ids=frozenset(target.eos_token_ids), **config))
    return expected, drafter, result


@pytest.mark.parametrize("draft_length", [DraftLength(), DraftLength.fixed(1), DraftLength.fixed(6)])
def test_loop_equals_reference_greedy(tiny_target, tiny_unrelated_draft, prompt, draft_length):
    expected, _, result = greedy_loop(tiny_target, tiny_unrelated_draft, prompt, draft_length=draft_length)
    assert result.tokens == expected
    # Never draft past the budget: the target adds one token of its own each round.
    assert sum(r.accepted + 1 for r in result.rounds) == len(result.tokens) or result.finish_reason == "eos"


def test_pipelined_loop_with_an_identical_drafter_never_waits_for_it(tiny_target, prompt):
    # The heuristic: it keeps drafting (the cost policy may stop drafting once it measures that an identical draft
    # model costs as much as the target, and then nothing would be drafted during a verify).
    expected, drafter, result = greedy_loop(tiny_target, tiny_target, prompt, pipeline=True,
                                            draft_length=DraftLength(policy="heuristic"))
    assert result.tokens == expected
    # Every bet wins: only the first round's draft was waited for; every later one was drafted during a verify.
    assert len(drafter.requested) == 1 and drafter.ahead_calls >= len(result.rounds) - 1


def test_the_pipelined_bet_drafts_the_next_round_and_one_token_more(tiny_target, prompt):
    """A fixed k = 3 with an identical drafter: each bet asks for exactly 3 + 1 tokens (the next round's draft and
    the guess of the target's own token), wins, and the round records that it won."""
    expected = reference_greedy(tiny_target.model, prompt, 30, set(tiny_target.eos_token_ids))
    drafter = InProcessDrafter(DraftEngine(tiny_target), prompt)
    bets = []
    plain_propose = drafter.propose

    def propose(k, after=()):
        if after:
            bets.append(k)
        return plain_propose(k, after)
    drafter.propose = propose
    result = speculative_decode(drafter, InProcessTarget(VerifyEngine(tiny_target), prompt),
                                LoopConfig(max_new_tokens=30, eos_token_ids=frozenset(tiny_target.eos_token_ids),
                                           pipeline=True, draft_length=DraftLength.fixed(3)))
    assert result.tokens == expected
    assert bets and set(bets) == {4}
    with_bet = [r.bet_won for r in result.rounds if r.bet_won is not None]
    assert len(with_bet) == len(bets) and all(with_bet)
    assert len(drafter.requested) == 1, "every later round's draft came from a bet"


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("draft_fixture", ["tiny_target", "tiny_unrelated_draft"])
def test_pipelined_loop_gives_the_same_output(tiny_target, prompt, temperature, draft_fixture, request):
    """Pipelining changes only who waits: greedy or sampled, the tokens are those of the plain loop."""
    params = SamplingParams(temperature=temperature)
    draft_model = request.getfixturevalue(draft_fixture)
    outputs = []
    for pipeline in (False, True):
        drafter = InProcessDrafter(DraftEngine(draft_model), prompt, params, seed=11)
        # The heuristic: its k depends only on what was accepted. Sampled output depends on how the rounds split,
        # and the cost policy's k follows measured timings, which differ from run to run.
        result = speculative_decode(drafter, InProcessTarget(VerifyEngine(tiny_target), prompt, params, seed=11),
                                    LoopConfig(max_new_tokens=30, pipeline=pipeline,
                                               draft_length=DraftLength(policy="heuristic")))
        outputs.append(result.tokens)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 30


def test_loop_stops_at_eos_and_on_request(tiny_target, prompt):
    expected = reference_greedy(tiny_target.model, prompt, 20)
    eos = expected[5]  # pretend the 6th token is an end-of-sequence token
    result = speculative_decode(None, InProcessTarget(VerifyEngine(tiny_target), prompt),
                                LoopConfig(max_new_tokens=20, eos_token_ids=frozenset({eos})))
    assert result.finish_reason == "eos" and result.tokens == expected[:expected.index(eos) + 1]
    seen = []
    result = speculative_decode(None, InProcessTarget(VerifyEngine(tiny_target), prompt),
                                LoopConfig(max_new_tokens=20), on_tokens=lambda new: seen.extend(new) or len(seen) >= 3)
    assert result.finish_reason == "stop" and result.tokens == expected[:3]


def test_loop_respects_the_token_budget(tiny_target, prompt):
    drafter = InProcessDrafter(DraftEngine(tiny_target), prompt)  # identical draft: everything accepted
    result = speculative_decode(drafter, InProcessTarget(VerifyEngine(tiny_target), prompt),
                                LoopConfig(max_new_tokens=7, draft_length=DraftLength.fixed(5)))
    assert len(result.tokens) == 7 and result.finish_reason in ("length", "eos")
    # Round one commits 5 drafts + the bonus token; with 1 token left, round two drafts nothing (k = 7 - 6 - 1 = 0).
    assert drafter.requested == [5]
    assert [r.drafted for r in result.rounds] == [5, 0]


def test_adaptive_draft_length_follows_the_heuristic():
    d = DraftLength(initial=4, minimum=1, maximum=8)
    all_in, some_out = [RoundRecord(4, 4, 0.1, 0.2)], [RoundRecord(4, 2, 0.1, 0.2)]
    assert d.next(4, all_in) == 6 and d.next(8, all_in) == 8 and d.next(4, some_out) == 3
    assert d.next(1, some_out) == 1
    assert d.next(5, [RoundRecord(0, 0, 0.0, 0.2)]) == 5, "a round without drafts (degraded drafter) changes nothing"
    assert DraftLength.fixed(3).next(3, all_in) == 3
    with pytest.raises(ValueError):
        DraftLength(initial=0, minimum=1)
    with pytest.raises(ValueError):
        LoopConfig(max_new_tokens=0)


def test_session_store_evicts_least_recently_used_and_idle(tiny_target):
    store = SessionStore(SessionLimits(max_sessions=2, idle_ttl_s=3600), kv_sessions(as_engine(tiny_target)))
    from specmesh.wire.history import EMPTY_HASH
    for sid in ("a", "b"):
        store.synced(sid, 0, EMPTY_HASH, [1, 2])
    store.synced("a", 2, store._sessions["a"].history.hash, [3])  # touch a: b is now least recently used
    store.synced("c", 0, EMPTY_HASH, [1])
    assert set(store._sessions) == {"a", "c"}
    clock = [0.0]
    expiring = SessionStore(SessionLimits(max_sessions=8, idle_ttl_s=10), kv_sessions(as_engine(tiny_target)))
    expiring._sessions = type(expiring._sessions)(maxsize=8, ttl=10, timer=lambda: clock[0])
    expiring.synced("x", 0, EMPTY_HASH, [1])
    clock[0] = 11.0
    assert len(expiring) == 0
    with pytest.raises(ValueError):
        SessionLimits(max_sessions=0)
