"""Cross-session draft batching: concurrent sessions' draft steps share one forward pass, each row stops at its own
k, and every proposal equals what the unbatched drafter proposes (tiny float64 models: agreement to rounding, so
greedy proposals are token-identical)."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from coordinator import Coordinator, GenerationOptions
from drafter.config import BatchingConfig, DrafterConfig
from drafter.engine import DraftEngine
from drafter.service import run_server as run_drafter
from specmesh.decoding.sampling import SamplingParams
from specmesh.ops import metrics
from specmesh.runtime.batched_forward import MAX_BATCHED_FRESH_TOKENS
from specmesh.wire.contract import Cancelled
from specmesh.wire.history import EMPTY_HASH, ResyncRequired, history_hash
from specmesh.worker.config import ModelConfig
from tests.helpers import reference_greedy
from verifier.service import run_server as run_verifier

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95)


def draft_passes(size: int) -> float:
    """Draft-model forward passes so far (this process) that drafted for exactly `size` sessions."""
    cumulative = {float(s.labels["le"]): s.value for family in metrics.DRAFT_BATCH_SIZE.collect()
                  for s in family.samples if s.name.endswith("_bucket")}
    below = [bound for bound in cumulative if bound < size]
    return cumulative[float(size)] - (cumulative[max(below)] if below else 0.0)


def engine(model, max_batch_size: int, **batching) -> DraftEngine:
    return DraftEngine(model, batching=BatchingConfig(max_batch_size=max_batch_size, **batching))


class Client:
    """One session as the coordinator keeps it: the committed history, and what the drafter has heard of it."""

    def __init__(self, session_id: str, prompt: list[int], k: int, params: SamplingParams = GREEDY,
                 seed: int = 0) -> None:
        self.session_id, self.history, self.k, self.params, self.seed = session_id, list(prompt), k, params, seed
        self.sent = 0

    def call(self) -> tuple:
        """propose() arguments for the next round: the tokens committed since the last call."""
        call = (self.session_id, self.sent, history_hash(self.history[:self.sent]), self.history[self.sent:], self.k,
                self.params, self.seed)
        self.sent = len(self.history)
        return call

    def commit(self, drafts: tuple[int, ...], accepted: int, correction: int) -> None:
        self.history += [*drafts[:accepted], correction]


def stepped(draft_engine: DraftEngine, arrivals: list[list[tuple]]) -> list:
    """Run propose calls from threads, the test itself taking each draft step: arrivals[i] are queued before step
    i (later calls join rows already drafting). Returns the outcomes (proposal or exception) in arrival order."""
    calls = [call for group in arrivals for call in group]
    results: list = [None] * len(calls)

    def call(i: int) -> None:
        try:
            results[i] = draft_engine.propose(*calls[i])
        except Exception as e:  # the test inspects it
            results[i] = e

    threads = []
    with draft_engine._model_lock:  # the callers block on it: only this thread steps
        for step, group in enumerate(arrivals):
            for _ in group:
                threads.append(threading.Thread(target=call, args=(len(threads),)))
                threads[-1].start()
            deadline = time.monotonic() + 10
            while len(draft_engine._queue) < len(group) and time.monotonic() < deadline:
                time.sleep(0.002)
            assert len(draft_engine._queue) == len(group)
            draft_engine._step()
        while draft_engine._drafting or draft_engine._queue:
            draft_engine._step()
    for t in threads:
        t.join(30)
    return results


def assert_same_proposal(got, want) -> None:
    assert got.tokens == want.tokens and got.committed_length == want.committed_length
    assert [d.token_ids for d in got.dists] == [d.token_ids for d in want.dists]
    for g, w in zip(got.dists, want.dists):
        assert g.probs == pytest.approx(w.probs, abs=1e-6)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_batched_rounds_equal_unbatched_proposals(tiny_target, params):
    """Five sessions with different prompts, lengths and k, over several rounds with partial acceptance (each row's
    cache rolled back its own way); one joins while the others draft, one brings a prompt long enough to be
    prefilled on its own."""
    rng = random.Random(11)
    vocab = tiny_target.vocab_size
    batched, alone = engine(tiny_target, 8), engine(tiny_target, 1)
    lengths = [3, 9, 17, 5, MAX_BATCHED_FRESH_TOKENS + 10]
    clients = [Client(f"s{i}", [rng.randrange(vocab) for _ in range(n)], k=1 + (2 * i) % 7, params=params, seed=i)
               for i, n in enumerate(lengths)]
    before = {size: draft_passes(size) for size in (1, 2, 3, 4)}
    for round_ in range(4):
        calls = [c.call() for c in clients]
        # Round 0: the last two sessions join after the first step. Later rounds: all start together.
        arrivals = [calls[:3], calls[3:]] if round_ == 0 else [calls]
        got = stepped(batched, arrivals)
        want = [alone.propose(*call) for call in calls]
        for g, w in zip(got, want):
            assert_same_proposal(g, w)
        for client, proposal in zip(clients, got):
            client.commit(proposal.tokens, rng.randrange(len(proposal.tokens) + 1), rng.randrange(vocab))
        clients[round_ % len(clients)].k = rng.randrange(1, 8)  # k changes between rounds
    assert sum(draft_passes(size) - before[size] for size in (2, 3, 4)) > 0, "no draft step was shared"


def test_rows_stop_at_their_own_k(tiny_target):
    """k = 1, 3, 5 together: three steps with 3 rows, then 2 rows, then 1, each answered with exactly its k."""
    batched, alone = engine(tiny_target, 8), engine(tiny_target, 1)
    clients = [Client(f"k{k}", [7, 8, 9, k], k) for k in (1, 3, 5)]
    calls = [c.call() for c in clients]
    before = [draft_passes(size) for size in (1, 2, 3)]
    got = stepped(batched, [calls])
    # Step 1: all three rows; steps 2-3: k=3 and k=5; steps 4-5: k=5 alone.
    assert [draft_passes(size) - b for size, b in zip((1, 2, 3), before)] == [2, 2, 1]
    assert [len(p.tokens) for p in got] == [1, 3, 5]
    assert got == [alone.propose(*call) for call in calls]


def test_max_batch_size_caps_the_rows(tiny_target):
    batched = engine(tiny_target, 2)
    calls = [Client(f"c{i}", [1, 2, 3 + i], 2).call() for i in range(3)]
    before = [draft_passes(size) for size in (1, 2, 3)]
    got = stepped(batched, [calls])
    # Two rows draft 2 steps together; the third joins when they leave and drafts alone.
    assert [draft_passes(size) - b for size, b in zip((1, 2, 3), before)] == [2, 2, 0]
    assert got == [engine(tiny_target, 1).propose(*call) for call in calls]


def test_failing_and_gone_callers_fail_alone(tiny_target):
    batched = engine(tiny_target, 8)
    good = Client("good", [1, 2, 3], 3).call()
    unknown = ("never-started", 3, 12345, [5], 2, GREEDY, 0)  # not a full history: must resync
    gone = ("gone", 0, EMPTY_HASH, [1, 2, 3], 2, GREEDY, 0, lambda: False)
    got = stepped(batched, [[good, unknown, gone]])
    assert isinstance(got[1], ResyncRequired) and isinstance(got[2], Cancelled)
    assert got[0] == engine(tiny_target, 1).propose(*good)
    assert len(batched.sessions) == 1, "neither failed caller left a session behind"


def test_a_caller_gone_while_drafting_leaves_the_batch(tiny_target):
    batched = engine(tiny_target, 8)
    steps_left = iter([True, True, False])  # active for its first two steps
    leaving = ("leaving", 0, EMPTY_HASH, [4, 5, 6], 6, GREEDY, 0, lambda: next(steps_left, False))
    staying = Client("staying", [1, 2, 3], 4).call()
    got = stepped(batched, [[leaving, staying]])
    assert isinstance(got[0], Cancelled)
    assert got[1] == engine(tiny_target, 1).propose(*staying)


def test_calls_of_one_session_run_in_order_not_together(tiny_target):
    batched = engine(tiny_target, 8)
    client = Client("same", [1, 2, 3], 2)
    first = client.call()
    expected_first = engine(tiny_target, 1).propose(*first)
    client.commit(expected_first.tokens, 1, 9)
    second = client.call()  # builds on the first call's history: only works if the first ran before it
    got = stepped(batched, [[first, second]])
    assert got[0] == expected_first
    assert got[1].committed_length == 5 and len(got[1].tokens) == 2


def test_batching_config_is_validated():
    with pytest.raises(ValueError, match="max_batch_size"):
        BatchingConfig(max_batch_size=0)
    with pytest.raises(ValueError, match="max_batch_wait_s"):
        BatchingConfig(max_batch_wait_s=-1)
    assert DrafterConfig(ModelConfig("tiny-random-qwen2")).batching == BatchingConfig()


def test_concurrent_generations_over_grpc_equal_unbatched_and_reference(tiny_target, tiny_unrelated_draft):
    """Five concurrent greedy generations (different prompts and draft lengths) through a batching drafter and
    verifier equal the same generations through unbatched workers and the target's own greedy decoding; their draft
    steps shared forward passes."""
    prompts = [tiny_target.tokenizer(text)["input_ids"] for text in
               ("def fibonacci(n):", "Once upon a time", "SELECT * FROM", "import numpy as np\n", "hello world")]
    expected = [reference_greedy(tiny_target.model, p, 20, set(tiny_target.eos_token_ids)) for p in prompts]
    options = [GenerationOptions(max_new_tokens=20, draft_tokens=k) for k in (2, 3, 4, 5, None)]

    def generate_all(batch_size: int) -> list[list[int]]:
        # A long wait window: on a busy machine a thread may be descheduled, and that must not prevent sharing.
        batching = dict(max_batch_size=batch_size, max_batch_wait_s=0.5 if batch_size > 1 else 0.0,
                        deterministic=False)  # cross-session batching: the mode that shares passes
        with run_verifier(tiny_target, port=0, **batching) as verifier, \
                run_drafter(tiny_unrelated_draft, port=0, **batching) as drafter, \
                Coordinator(verifier=verifier.address, drafter=drafter.address, tokenizer=tiny_target.tokenizer) as c, \
                ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(lambda i: c.generate(list(prompts[i]), options[i]), range(len(prompts))))
        return [r.token_ids for r in results]

    before = sum(draft_passes(size) for size in (2, 3, 4, 6))
    batched = generate_all(8)
    shared = sum(draft_passes(size) for size in (2, 3, 4, 6)) - before
    assert batched == expected
    assert generate_all(1) == expected
    assert shared > 0, "concurrent sessions' draft steps should have shared forward passes"
