"""Cross-session batching: several sessions' verifications in one target forward pass, each with its own KV cache,
must compute what each would compute alone (tiny float64 models, so agreement is to rounding)."""

from __future__ import annotations

import random
import threading
import time
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from coordinator import Coordinator, GenerationOptions
from drafter.service import run_server as run_drafter
from specmesh.ops import metrics
from specmesh.runtime.batched_forward import MAX_BATCHED_FRESH_TOKENS, batched_logits, can_batch
from specmesh.wire.history import EMPTY_HASH, ResyncRequired, history_hash
from specmesh.runtime.kv_cache import CachedSequence
from specmesh.decoding.sampling import SamplingParams
from specmesh.wire.contract import Cancelled
from tests.helpers import reference_greedy
from verifier.config import BatchingConfig
from verifier.decode_stream import DecodeSteps, decode_stream
from verifier.engine import VerifyEngine
from verifier.service import run_server as run_verifier


def batched_passes_of_at_least(size: int) -> float:
    """Forward passes so far (this process) that verified `size` or more sessions, from the metric's histogram."""
    cumulative = {float(s.labels["le"]): s.value for family in metrics.VERIFY_BATCH_SIZE.collect()
                  for s in family.samples if s.name.endswith("_bucket")}
    below = [bound for bound in cumulative if bound < size]
    return cumulative[float("inf")] - (cumulative[max(below)] if below else 0.0)


@pytest.mark.parametrize("model_fixture", ["tiny_target", "tiny_other_tokenizer"])
def test_batched_logits_equal_one_row_at_a_time(model_fixture, request):
    model = request.getfixturevalue(model_fixture).model
    assert can_batch(model)
    rng = random.Random(7)
    vocab = model.config.vocab_size
    batched = [CachedSequence(model) for _ in range(4)]
    alone = [CachedSequence(model) for _ in range(4)]
    histories = [[rng.randrange(vocab) for _ in range(rng.randrange(3, 20))] for _ in range(4)]
    for step in range(6):
        requests, last_ns = [], []
        for history in histories:
            k = rng.randrange(0, 6)  # differing fresh lengths, including none but the bonus position
            requests.append(history + [rng.randrange(vocab) for _ in range(k)])
            last_ns.append(k + 1)
        got = batched_logits(model, batched, requests, last_ns)
        want = [s.logits_for(r, n) for s, r, n in zip(alone, requests, last_ns)]
        for g, w in zip(got, want):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=0, atol=1e-10)
        assert [s.cached_tokens for s in batched] == [s.cached_tokens for s in alone]
        for i, (history, request_tokens, last_n) in enumerate(zip(histories, requests, last_ns)):
            keep = len(history) + rng.randrange(0, last_n)  # reject some drafts: explicit rollback per row
            histories[i] = request_tokens[:keep] + [rng.randrange(vocab)]
            batched[i].rollback(keep)
            alone[i].rollback(keep)
        if step == 3:  # a brand-new session (empty cache) joins rows with long caches
            batched[0], alone[0] = CachedSequence(model), CachedSequence(model)


def test_batched_logits_refuses_a_sequence_twice(tiny_target):
    sequence = CachedSequence(tiny_target.model)
    with pytest.raises(ValueError, match="only once"):
        batched_logits(tiny_target.model, [sequence, sequence], [[1, 2], [1, 2]], [1, 1])


def batching_engine(model, max_batch_size: int, **batching) -> VerifyEngine:
    return VerifyEngine(model, batching=BatchingConfig(max_batch_size=max_batch_size, **batching))


def queued_together(engine: VerifyEngine, calls: list[tuple]) -> list:
    """Run `calls` (verify arguments) from threads while the model is held, so that all of them queue up and the
    next forward pass takes them together. Returns each call's outcome or exception."""
    results: list = [None] * len(calls)

    def call(i: int) -> None:
        try:
            results[i] = engine.verify(*calls[i])
        except Exception as e:  # the test inspects it
            results[i] = e

    with engine._model_lock:
        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(calls))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while len(engine._queue) < len(calls) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(engine._queue) == len(calls)
    for t in threads:
        t.join(30)
    return results


def greedy_call(session: str, prompt: list[int], drafts: list[int]) -> tuple:
    return (session, 0, EMPTY_HASH, prompt, drafts, [], SamplingParams(), 0)


def test_engine_batches_queued_sessions_and_each_gets_its_own_answer(tiny_target):
    engine, alone = batching_engine(tiny_target, 8), batching_engine(tiny_target, 1)
    rng = random.Random(3)
    vocab = tiny_target.vocab_size
    calls = [greedy_call(f"s{i}", [rng.randrange(vocab) for _ in range(5 + 3 * i)],
                         [rng.randrange(vocab) for _ in range(i + 1)]) for i in range(5)]
    before = batched_passes_of_at_least(5)
    got = queued_together(engine, calls)
    assert batched_passes_of_at_least(5) == before + 1
    assert got == [alone.verify(*call) for call in calls]


def test_one_bad_request_fails_alone(tiny_target):
    engine = batching_engine(tiny_target, 8)
    good = greedy_call("good", [1, 2, 3], [4])
    unknown = ("never-started", 3, 12345, [5], [6], [], SamplingParams(), 0)  # not a full history: must resync
    got = queued_together(engine, [good, unknown])
    assert isinstance(got[1], ResyncRequired)
    assert got[0] == batching_engine(tiny_target, 1).verify(*good)


def test_calls_of_one_session_run_in_order_not_together(tiny_target):
    engine = batching_engine(tiny_target, 8)
    first = greedy_call("same", [1, 2, 3], [])
    # The second call carries the first call's outcome as its base: it only works if the first ran before it.
    expected_first = VerifyEngine(tiny_target).verify(*first)
    history = [1, 2, 3, expected_first.verdict.next_token]
    second = ("same", len(history), history_hash(history), [], [], [], SamplingParams(), 0)
    got = queued_together(engine, [first, second])
    assert got[0] == expected_first
    assert got[1].committed_length == 5


def test_long_prompt_is_prefilled_on_its_own(tiny_target):
    engine, alone = batching_engine(tiny_target, 8), batching_engine(tiny_target, 1)
    calls = [greedy_call("long", list(range(MAX_BATCHED_FRESH_TOKENS + 20)), [7, 8]),
             greedy_call("short", [3, 4, 5], [6])]
    assert queued_together(engine, calls) == [alone.verify(*call) for call in calls]


@contextmanager
def busy_model(engine: VerifyEngine, busy_s: float = 0.03):
    """Keep taking the engine's model for `busy_s` at a time, as a big model's forward pass would: calls arriving
    meanwhile queue up, as they do on a real verifier under load."""
    stop = threading.Event()

    def hog() -> None:
        while not stop.is_set():
            with engine._model_lock:
                time.sleep(busy_s)
            time.sleep(0.001)

    thread = threading.Thread(target=hog, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def test_concurrent_generations_over_grpc_equal_reference_greedy(tiny_target, tiny_unrelated_draft):
    prompts = [tiny_target.tokenizer(text)["input_ids"] for text in
               ("def fibonacci(n):", "Once upon a time", "SELECT * FROM", "import numpy as np\n", "hello world")]
    expected = [reference_greedy(tiny_target.model, p, 24, set(tiny_target.eos_token_ids)) for p in prompts]
    before = batched_passes_of_at_least(2)
    with run_verifier(tiny_target, port=0, deterministic=False) as verifier, \
            run_drafter(tiny_unrelated_draft, port=0, deterministic=False) as drafter, \
            Coordinator(verifier=verifier.address, drafter=drafter.address, tokenizer=tiny_target.tokenizer) as c, \
            busy_model(verifier.engine), ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: c.generate(list(p), GenerationOptions(max_new_tokens=24)), prompts))
    assert [r.token_ids for r in results] == expected
    assert batched_passes_of_at_least(2) > before, "concurrent sessions should have shared forward passes"


def test_a_caller_gone_while_queued_costs_no_forward_pass(tiny_target):
    engine = batching_engine(tiny_target, 8)
    gone = ("gone", 0, EMPTY_HASH, [1, 2, 3], [4], [], SamplingParams(), 0, lambda: False)
    here = greedy_call("here", [1, 2, 3], [4])
    got = queued_together(engine, [gone, here])
    assert isinstance(got[0], Cancelled)
    assert got[1] == VerifyEngine(tiny_target).verify(*here)
    assert len(engine.sessions) == 1, "the gone caller's session was never even created"


def decode_steps(engine: VerifyEngine, session: str, prompt: list[int], steps: int) -> list[int]:
    """Target-only decoding through `engine`, syncing deltas like the coordinator, each call 10 ms after the last
    answer (the network and the coordinator's turnaround)."""
    history = list(prompt)
    sent = 0
    for step in range(steps):
        if step:
            time.sleep(0.01)
        outcome = engine.verify(session, sent, history_hash(history[:sent]), history[sent:], [], [],
                                SamplingParams(), 0)
        history.append(outcome.verdict.next_token)
        sent = len(history)
    return history[len(prompt):]


def test_active_sessions_are_waited_for_instead_of_alternating(tiny_target):
    """Two sessions calling back right after each answer: with a short wait window they share passes (without it they
    tend to alternate: one runs while the other queues); outputs stay each session's own greedy decoding."""
    # A window far longer than the callers' 10 ms turnaround: on a busy machine a thread may be descheduled for a
    # while, and that must not turn into a miss (the window never delays a pass whose callers are all back).
    engine = batching_engine(tiny_target, 8, max_batch_wait_s=1.0)
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    before_pairs, before_all = batched_passes_of_at_least(2), batched_passes_of_at_least(1)
    with ThreadPoolExecutor(2) as pool:
        outputs = list(pool.map(lambda i: decode_steps(engine, f"s{i}", prompts[i], 12), range(2)))
    pairs, passes = batched_passes_of_at_least(2) - before_pairs, batched_passes_of_at_least(1) - before_all
    assert outputs == [reference_greedy(tiny_target.model, p, 12) for p in prompts]
    assert pairs >= 10 and passes <= 14, f"{pairs} shared passes of {passes}"


def test_concurrent_decode_streams_share_every_pass(tiny_target):
    """Concurrent Decode streams (target-only generations) share every pass once they have started: no stream may miss
    the next batch while another runs it (measured on the real target when waiting callers needed the model to learn
    their answers: 72 steps of three streams in 35 passes instead of 25)."""
    prompts = [tiny_target.tokenizer(text)["input_ids"] for text in ("def fibonacci(n):", "Once upon a", "SELECT")]
    expected = [reference_greedy(tiny_target.model, p, 16, set(tiny_target.eos_token_ids)) for p in prompts]
    with run_verifier(tiny_target, port=0, max_batch_wait_s=0.5, deterministic=False) as verifier, \
            Coordinator(verifier=verifier.address, tokenizer=tiny_target.tokenizer) as coordinator, \
            ThreadPoolExecutor(len(prompts)) as pool:
        forward = verifier.engine.loaded.batched_logits

        def slow_forward(*args):  # as long as a real model's pass: the callers' timing is a real one's
            time.sleep(0.05)
            return forward(*args)

        verifier.engine.loaded.batched_logits = slow_forward
        before = batched_passes_of_at_least(1)
        options = GenerationOptions(max_new_tokens=16, draft_tokens=0)
        results = list(pool.map(lambda p: coordinator.generate(list(p), options), prompts))
        passes = batched_passes_of_at_least(1) - before
    assert [r.token_ids for r in results] == expected
    steps = max(len(r.token_ids) for r in results)
    assert passes <= steps + 3, f"{sum(len(r.token_ids) for r in results)} steps in {passes} passes"


def test_a_streams_steps_run_back_to_back_on_the_model_thread(tiny_target):
    """A Decode stream hands the model thread its first step only: each later step is queued on the model thread as
    the previous one is answered, and runs there without a hand-off to the stream's thread and back."""
    engine = batching_engine(tiny_target, 8)
    handed_over = []
    run_on_model_thread = engine.loaded.run_on_model_thread

    def counting(fn, *args):
        if threading.current_thread().name == "decode-stream":
            handed_over.append(fn)
        return run_on_model_thread(fn, *args)

    engine.loaded.run_on_model_thread = counting
    steps = DecodeSteps("s", 0, EMPTY_HASH, (5, 6, 7), 12, frozenset(), SamplingParams(), 0)
    messages = list(decode_stream(engine, steps, lambda: True, lambda: None))
    assert all(len(m) == 1 for m in messages)  # no flush interval: each outcome as it is committed
    outcomes = [o for m in messages for o in m]
    assert [o.verdict.next_token for o in outcomes] == reference_greedy(tiny_target.model, [5, 6, 7], 12)
    assert [o.committed_length for o in outcomes] == list(range(4, 16))
    assert len(handed_over) == 1, f"{len(handed_over)} hand-offs for 12 steps"


def test_a_stream_stops_where_its_caller_has_gone_and_where_before_step_raises(tiny_target):
    engine = batching_engine(tiny_target, 8)
    steps = DecodeSteps("s", 0, EMPTY_HASH, (5, 6, 7), 12, frozenset(), SamplingParams(), 0)
    calls = []

    def stop_at_the_fourth() -> None:
        calls.append(1)
        if len(calls) == 4:
            raise Cancelled("the verifier is stopping")

    received = []
    with pytest.raises(Cancelled):
        for message in decode_stream(engine, steps, lambda: True, stop_at_the_fourth):
            received.extend(message)
    assert len(received) == 3

    active = iter([True] * 5 + [False] * 100)
    gone = list(decode_stream(engine, DecodeSteps("t", 0, EMPTY_HASH, (5, 6), 12, frozenset(), SamplingParams(), 0),
                              lambda: next(active), lambda: None))
    assert 1 <= len(gone) < 12


def test_a_stream_with_a_flush_interval_hands_over_what_it_held_together(tiny_target):
    """With a flush interval, the first outcome goes at once, the later ones in lists of those held meanwhile, the
    last with the stream's end; the same outcomes in the same order as without. Where the stream stops early, what
    it held is handed over before the error."""
    engine = batching_engine(tiny_target, 8)
    alone = [o for m in decode_stream(engine, DecodeSteps("a", 0, EMPTY_HASH, (5, 6, 7), 12, frozenset(),
                                                          SamplingParams(), 0), lambda: True, lambda: None) for o in m]
    held = DecodeSteps("b", 0, EMPTY_HASH, (5, 6, 7), 12, frozenset(), SamplingParams(), 0, flush_interval_s=60.0)
    messages = list(decode_stream(engine, held, lambda: True, lambda: None))
    assert [len(m) for m in messages] == [1, 11]
    assert [(o.verdict.next_token, o.committed_length) for m in messages for o in m] == \
        [(o.verdict.next_token, o.committed_length) for o in alone]
    every_step = DecodeSteps("c", 0, EMPTY_HASH, (5, 6, 7), 5, frozenset(), SamplingParams(), 0, 1e-9)
    assert [len(m) for m in decode_stream(engine, every_step, lambda: True, lambda: None)] == [1] * 5

    calls, received = [], []

    def stop_at_the_fourth() -> None:
        calls.append(1)
        if len(calls) == 4:
            raise Cancelled("the verifier is stopping")

    stopped = DecodeSteps("d", 0, EMPTY_HASH, (5, 6, 7), 12, frozenset(), SamplingParams(), 0, flush_interval_s=60.0)
    with pytest.raises(Cancelled):
        for message in decode_stream(engine, stopped, lambda: True, stop_at_the_fourth):
            received.append(len(message))
    assert received == [1, 2]
    with pytest.raises(ValueError, match="flush_interval_s"):
        DecodeSteps("e", 0, EMPTY_HASH, (5,), 2, frozenset(), SamplingParams(), 0, flush_interval_s=-1.0)


def test_a_stream_asked_to_guess_does_so_only_where_a_guess_is_free_and_commits_the_target_s_own_tokens(
        tiny_target, monkeypatch):
    """DecodeSteps.guess: where the engine's one-token step runs a spare row anyway (ik, repacked and exact), each
    step checks a guess of the next token there; a right one commits two tokens in the step. The tokens stay the
    target's own greedy decoding, the stream never goes past max_tokens, and a stop token is never guessed (the
    stream ends at it)."""
    engine = batching_engine(tiny_target, 8)
    prompt, count = (5, 6, 7, 5, 6, 7, 5, 6), 40
    expected = reference_greedy(tiny_target.model, list(prompt), count)

    def outcomes(session: str, steps: int, stops=frozenset()) -> list:
        asked = DecodeSteps(session, 0, EMPTY_HASH, prompt, steps, stops, SamplingParams(), 0, guess=True)
        return [o for m in decode_stream(engine, asked, lambda: True, lambda: None) for o in m]

    # This engine (transformers) pays for a second row: no guesses.
    assert not engine.guesses_are_free
    plain = outcomes("plain", count)
    assert [o.verdict.next_token for o in plain] == expected and not any(o.guesses for o in plain)

    monkeypatch.setattr(VerifyEngine, "guesses_are_free", property(lambda self: True))
    guessed = outcomes("guessed", count)
    assert [t for o in guessed for t in o.committed] == expected
    assert guessed[-1].committed_length == len(prompt) + count
    right = sum(len(o.accepted_guesses) for o in guessed)
    assert sum(o.guesses for o in guessed) >= right > 0 and len(guessed) == count - right, \
        f"{right} right guesses in {len(guessed)} steps"
    for steps in (1, 2, 7):  # a right guess with one token left would go past the end: the last step never guesses
        assert [t for o in outcomes(f"short-{steps}", steps) for t in o.committed] == expected[:steps]
    stop = expected[len(expected) // 2]
    until_stop = expected[:expected.index(stop) + 1]
    stopped = outcomes("stopped", count, frozenset({stop}))
    assert [t for o in stopped for t in o.committed] == until_stop
    assert stop not in [t for o in stopped for t in o.accepted_guesses]


def test_the_cost_probe_giving_its_session_up_counts_as_a_request_so_the_idle_upkeep_looks_again(tiny_target):
    """The idle upkeep (an ik engine's spare context) declines while any session holds a context, the cost probe's
    included, and looks again only after a request: the probe's end must count as one, as end_session does, or a first
    session that ended while the probe measured leaves the worker without a spare (CI: the spare context test timed
    out waiting for it)."""
    engine = batching_engine(tiny_target, 8)
    engine._probe_verify(0)  # the probe's first call: its session, prefilled
    assert engine._probe_session is not None
    arrivals = engine._activity.arrivals
    engine._drop_probe_session()
    assert engine._probe_session is None and engine._activity.arrivals == arrivals + 1
    assert engine._activity.wait_until_quiet(0.0, threading.Event()) == arrivals + 1  # nothing left in flight
