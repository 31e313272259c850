"""Real gRPC servers on ephemeral ports with tiny random models (float64, so exactness is asserted exactly)."""

from __future__ import annotations

import grpc
import pytest

from coordinator import Coordinator, GenerationOptions
from coordinator.fleet.channel import new_session_id
from coordinator.fleet.worker_client import RemoteWorker
from drafter.service import run_server as run_drafter
from specmesh.wire.history import EMPTY_HASH, history_hash
from specmesh.v1 import specmesh_pb2 as pb
from tests.helpers import reference_greedy, wait_for_costs
from verifier.service import run_server as run_verifier

PROMPT_TEXT = "def fibonacci(n):\n    "
MAX_NEW = 40


# Each worker has measured its costs (in the background, after SERVING) before a coordinator reads them: a seeded sampled
# generation repeats itself only with the same cost prior.
@pytest.fixture(scope="module")
def verifier(tiny_target):
    with run_verifier(tiny_target, port=0) as server:
        wait_for_costs(server.address, "verifier")
        yield server


@pytest.fixture(scope="module")
def same_drafter(tiny_target):
    with run_drafter(tiny_target, port=0) as server:
        wait_for_costs(server.address, "drafter")
        yield server


@pytest.fixture(scope="module")
def unrelated_drafter(tiny_unrelated_draft):
    with run_drafter(tiny_unrelated_draft, port=0) as server:
        wait_for_costs(server.address, "drafter")
        yield server


@pytest.fixture(scope="module")
def prompt(tiny_target):
    return tiny_target.tokenizer(PROMPT_TEXT)["input_ids"]


@pytest.fixture(scope="module")
def expected(tiny_target, prompt):
    return reference_greedy(tiny_target.model, prompt, MAX_NEW, set(tiny_target.eos_token_ids))


def generate(verifier, drafter, tokenizer, prompt, **options):
    with Coordinator(verifier=verifier.address, drafter=drafter.address if drafter else None,
                     tokenizer=tokenizer) as c:
        return c.generate(list(prompt), GenerationOptions(max_new_tokens=MAX_NEW, **options))


def test_target_only_equals_reference_greedy(verifier, tiny_target, prompt, expected):
    result = generate(verifier, None, tiny_target.tokenizer, prompt, draft_tokens=0)
    assert result.token_ids == expected
    assert len(set(expected)) > 5, "the tiny model should not be degenerate"
    assert result.stats["rounds"] == len(expected)


def test_target_only_tokens_held_by_the_verifier_come_together_unless_stop_strings_are_set(verifier, tiny_target,
                                                                                             prompt, expected):
    """With a flush interval longer than the generation, the first token comes alone and the rest in one message
    (its rounds share the wait evenly); the tokens are the same. A generation with a stop string gets every token at
    once, since only the coordinator sees stop strings."""
    held = generate(verifier, None, tiny_target.tokenizer, prompt, draft_tokens=0, stream_flush_s=10.0)
    assert held.token_ids == expected and held.stats["rounds"] == len(expected)
    assert len({r.verify_s for r in held.rounds[1:]}) == 1
    never = "\x00 never in the text"
    each = generate(verifier, None, tiny_target.tokenizer, prompt, draft_tokens=0, stream_flush_s=10.0, stop=(never,))
    assert each.token_ids == expected and len({r.verify_s for r in each.rounds[1:]}) > len(expected) // 2


HEURISTIC = "heuristic"


@pytest.mark.parametrize("k", [None, 1, 3, 8])
def test_identical_draft_accepts_everything(verifier, same_drafter, tiny_target, prompt, expected, k):
    # k = None: adaptive by the heuristic, which always drafts (the default cost policy may find that a draft model as
    # large as the target never pays, and rightly not draft).
    result = generate(verifier, same_drafter, tiny_target.tokenizer, prompt, draft_tokens=k, draft_policy=HEURISTIC)
    assert result.token_ids == expected
    assert result.stats["acceptance_rate"] == 1.0
    assert result.stats["rounds"] < len(expected)


@pytest.mark.parametrize("drafter_fixture", ["same_drafter", "unrelated_drafter"])
def test_pipelined_generation_equals_reference_greedy(verifier, tiny_target, prompt, expected, drafter_fixture,
                                                       request):
    drafter = request.getfixturevalue(drafter_fixture)
    result = generate(verifier, drafter, tiny_target.tokenizer, prompt, pipeline=True, draft_policy=HEURISTIC)
    assert result.token_ids == expected
    if drafter_fixture == "same_drafter":  # every bet wins: rounds after the first need no wait for the drafter
        assert result.stats["acceptance_rate"] == 1.0


@pytest.mark.parametrize("k", [None, 2, 5])
def test_unrelated_draft_still_gives_target_output(verifier, unrelated_drafter, tiny_target, prompt, expected, k):
    result = generate(verifier, unrelated_drafter, tiny_target.tokenizer, prompt, draft_tokens=k,
                      draft_policy=HEURISTIC)
    assert result.token_ids == expected
    assert result.stats["acceptance_rate"] < 0.5


def test_text_streams_and_stop_strings(verifier, same_drafter, tiny_target, prompt, expected):
    pieces: list[str] = []
    with Coordinator(verifier=verifier.address, drafter=same_drafter.address, tokenizer=tiny_target.tokenizer) as c:
        # The heuristic policy: rounds (and so the text's pieces) do not depend on measured timings. The tiny model's
        # random bytes decode to U+FFFD here and there, and a stop string holding one is found or not depending on
        # where rounds split the bytes (a known limitation of the incremental detokeniser with invalid UTF-8).
        options = dict(max_new_tokens=MAX_NEW, draft_policy=HEURISTIC)
        full = c.generate(list(prompt), GenerationOptions(**options), on_text=pieces.append)
        assert "".join(pieces) == full.text == tiny_target.tokenizer.decode(expected, skip_special_tokens=True)
        stop = full.text[10:13]
        stopped = c.generate(list(prompt), GenerationOptions(**options, stop=(stop,)))
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[:full.text.index(stop)]
    assert stop not in stopped.text


def test_seeded_sampling_repeats_and_seeds_differ(verifier, unrelated_drafter, tiny_target, prompt):
    runs = [generate(verifier, unrelated_drafter, tiny_target.tokenizer, prompt, temperature=1.0, top_p=0.95,
                     seed=seed).token_ids for seed in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_session_survives_a_verifier_restart(tiny_target, prompt, expected):
    """A restarted server knows nothing of the session: the client resyncs with the full history, nothing lost."""
    servers = {}
    with run_verifier(tiny_target, port=0) as first:
        servers["current"] = first
        restarted = []

        def restart_once(text: str) -> None:
            if not restarted:  # stop the verifier mid-generation, start a fresh one on the same port
                port = servers["current"].port
                servers["current"].stop(grace=0)
                servers["current"] = stack.enter_context(run_verifier(tiny_target, port=port))
                restarted.append(port)

        from contextlib import ExitStack
        with ExitStack() as stack, Coordinator(verifier=first.address, tokenizer=tiny_target.tokenizer) as c:
            result = c.generate(list(prompt), GenerationOptions(max_new_tokens=MAX_NEW, draft_tokens=0),
                                on_text=restart_once)
    assert restarted
    assert result.token_ids == expected
    assert result.stats["resyncs"] >= 1  # the fresh server rebuilt the session from the full history


# ---- bad input: INVALID_ARGUMENT with a message, and the server keeps serving ----

def _ctx(tokens):
    return pb.ContextSync(base_length=0, base_hash=EMPTY_HASH, new_tokens=tokens)


BAD_VERIFY = {
    "token out of range": dict(context=_ctx([1, 2, 10**6]), session_id="s"),
    "negative token": dict(context=_ctx([1, -3]), session_id="s"),
    "draft out of range": dict(context=_ctx([1, 2]), draft_tokens=[99999], session_id="s"),
    "too many drafts": dict(context=_ctx([1, 2]), draft_tokens=[1] * 33, session_id="s"),
    "empty session id": dict(context=_ctx([1, 2]), session_id=""),
    "huge session id": dict(context=_ctx([1, 2]), session_id="x" * 500),
    "empty context": dict(context=_ctx([]), session_id="s"),
    "negative temperature": dict(context=_ctx([1, 2]), session_id="s", sampling=pb.SamplingParams(temperature=-1)),
    "top_p above 1": dict(context=_ctx([1, 2]), session_id="s", sampling=pb.SamplingParams(temperature=1, top_p=2)),
    "missing distributions": dict(context=_ctx([1, 2]), session_id="s", draft_tokens=[3],
                                  sampling=pb.SamplingParams(temperature=1)),
    "distribution not normalised": dict(
        context=_ctx([1, 2]), session_id="s", draft_tokens=[3], sampling=pb.SamplingParams(temperature=1),
        draft_distributions=[pb.SparseDistribution(token_ids=[3, 4], probs=[0.9, 0.9])]),
    "NaN probability": dict(
        context=_ctx([1, 2]), session_id="s", draft_tokens=[3], sampling=pb.SamplingParams(temperature=1),
        draft_distributions=[pb.SparseDistribution(token_ids=[3], probs=[float("nan")])]),
    "draft not in its distribution": dict(
        context=_ctx([1, 2]), session_id="s", draft_tokens=[3], sampling=pb.SamplingParams(temperature=1),
        draft_distributions=[pb.SparseDistribution(token_ids=[4], probs=[1.0])]),
}


@pytest.mark.parametrize("case", list(BAD_VERIFY))
def test_verifier_rejects_bad_input_and_keeps_serving(verifier, case):
    worker = RemoteWorker(verifier.address, "verifier")
    try:
        with pytest.raises(grpc.RpcError) as error:
            worker.stub.Verify(pb.VerifyRequest(**BAD_VERIFY[case]), timeout=10)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.details()
        ok = worker.stub.Verify(pb.VerifyRequest(session_id="ok", context=_ctx([1, 2, 3])), timeout=10)
        assert ok.committed_length == 4
    finally:
        worker.close()


BAD_PROPOSE = {
    "k = 0": dict(num_tokens=0),
    "k too large": dict(num_tokens=1000),
    "token out of range": dict(num_tokens=2, context=_ctx([5, 10**7])),
    "empty session id": dict(num_tokens=2, session_id=""),
    "top_k negative": dict(num_tokens=2, sampling=pb.SamplingParams(temperature=1, top_k=-5)),
}


@pytest.mark.parametrize("case", list(BAD_PROPOSE))
def test_drafter_rejects_bad_input_and_keeps_serving(unrelated_drafter, case):
    request = dict(session_id="s", context=_ctx([1, 2, 3]))
    request.update(BAD_PROPOSE[case])
    worker = RemoteWorker(unrelated_drafter.address, "drafter")
    try:
        with pytest.raises(grpc.RpcError) as error:
            worker.stub.Propose(pb.ProposeRequest(**request), timeout=10)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        ok = worker.stub.Propose(pb.ProposeRequest(session_id="ok", context=_ctx([1, 2]), num_tokens=3), timeout=10)
        assert len(ok.tokens) == 3
    finally:
        worker.close()


def test_unknown_session_or_diverged_history_asks_for_resync(verifier):
    worker = RemoteWorker(verifier.address, "verifier")
    try:
        stale = pb.ContextSync(base_length=5, base_hash=history_hash([1, 2, 3, 4, 5]), new_tokens=[6])
        with pytest.raises(grpc.RpcError) as error:
            worker.stub.Verify(pb.VerifyRequest(session_id=new_session_id(), context=stale), timeout=10)
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error.value.details().startswith("resync:")
    finally:
        worker.close()


def test_info_reports_model_and_fingerprint(verifier, tiny_target):
    worker = RemoteWorker(verifier.address, "verifier")
    try:
        info = worker.info()
    finally:
        worker.close()
    assert info.model_name == "tiny-random-qwen2"
    assert info.tokenizer_fingerprint == tiny_target.fingerprint
    assert info.vocab_size == tiny_target.vocab_size and info.dtype == "float64" and info.role == "verifier"
    assert list(info.eos_token_ids) == list(tiny_target.eos_token_ids)


def test_bad_generation_options_are_refused():
    for bad in (dict(max_new_tokens=-1), dict(max_new_tokens=0), dict(temperature=-0.5), dict(top_p=0.0),
                dict(draft_tokens=-2), dict(seed=-1), dict(stream_flush_s=-0.1), dict(stream_flush_s=11.0)):
        with pytest.raises(ValueError):
            GenerationOptions(**bad)


# ---- Decode: target-only steps streamed by the verifier ----

def _decode(worker, session_id, tokens, max_tokens, **fields):
    return worker.stub.Decode(pb.DecodeRequest(session_id=session_id, context=_ctx(tokens), max_tokens=max_tokens,
                                               **fields), timeout=30)


def _verify_rounds(worker, session_id, tokens, count, **fields):
    """What `count` Verify calls without drafts commit, each building on the last."""
    history = list(tokens)
    for i in range(count):
        context = _ctx(tokens) if i == 0 else pb.ContextSync(base_length=len(history),
                                                               base_hash=history_hash(history))
        reply = worker.stub.Verify(pb.VerifyRequest(session_id=session_id, context=context, **fields), timeout=30)
        history.append(reply.next_token)
        assert reply.committed_length == len(history)
    return history[len(tokens):]


@pytest.mark.parametrize("sampling", [None, pb.SamplingParams(temperature=1.0, top_k=50)], ids=["greedy", "sampled"])
def test_a_decode_stream_gives_what_verify_rounds_give(verifier, prompt, expected, sampling):
    fields = {} if sampling is None else {"sampling": sampling, "seed": 7}
    worker = RemoteWorker(verifier.address, "verifier")
    try:
        streamed = list(_decode(worker, new_session_id(), prompt, 12, **fields))
        assert [r.committed_length for r in streamed] == [len(prompt) + i for i in range(1, 13)]
        tokens = [r.token for r in streamed]
        assert tokens == _verify_rounds(worker, new_session_id(), prompt, 12, **fields)
        if sampling is None:
            assert tokens == expected[:12]
    finally:
        worker.close()


def test_a_decode_stream_with_a_flush_interval_sends_what_it_held_together(verifier, prompt, expected):
    """The first token at once, the rest held (10 s is longer than the stream) and sent with its end: the same
    tokens as one a message, the committed length of each message's last token; a stop token still ends it."""
    worker = RemoteWorker(verifier.address, "verifier")
    try:
        messages = list(_decode(worker, new_session_id(), prompt, 12, flush_interval_ms=10_000))
        assert [[m.token, *m.more_tokens] for m in messages] == [expected[:1], expected[1:12]]
        assert [m.committed_length for m in messages] == [len(prompt) + 1, len(prompt) + 12]
        stop = expected[5]
        stopped = list(_decode(worker, new_session_id(), prompt, 30, stop_token_ids=[stop], flush_interval_ms=10_000))
        assert [t for m in stopped for t in [m.token, *m.more_tokens]] == expected[:expected.index(stop) + 1]
    finally:
        worker.close()


def test_a_decode_stream_ends_at_a_stop_token(verifier, prompt, expected):
    worker = RemoteWorker(verifier.address, "verifier")
    try:
        stop = expected[5]
        streamed = [r.token for r in _decode(worker, new_session_id(), prompt, 30, stop_token_ids=[stop])]
        assert streamed == expected[:expected.index(stop) + 1]
    finally:
        worker.close()


def test_a_cancelled_stream_leaves_a_session_the_client_continues_from_its_own_length(verifier, prompt, expected):
    worker = RemoteWorker(verifier.address, "verifier")
    session = new_session_id()
    try:
        stream = _decode(worker, session, prompt, 30)
        taken = [next(stream).token for _ in range(3)]
        stream.cancel()  # a stop string: the server may have decoded a step or two past what the client took
        history = list(prompt) + taken
        reply = worker.stub.Verify(pb.VerifyRequest(session_id=session, context=pb.ContextSync(
            base_length=len(history), base_hash=history_hash(history))), timeout=30)
        assert taken + [reply.next_token] == expected[:4] and reply.committed_length == len(history) + 1
    finally:
        worker.close()


BAD_DECODE = {
    "max_tokens 0": dict(max_tokens=0),
    "past the context": dict(max_tokens=10**6),
    "stop token out of range": dict(stop_token_ids=[10**6]),
    "empty session id": dict(session_id=""),
    "token out of range": dict(context=_ctx([1, 10**6])),
    "flush interval past the limit": dict(flush_interval_ms=10_001),
}


@pytest.mark.parametrize("case", list(BAD_DECODE))
def test_decode_rejects_bad_input_and_keeps_serving(verifier, case):
    request = dict(session_id="s", context=_ctx([1, 2, 3]), max_tokens=4)
    request.update(BAD_DECODE[case])
    worker = RemoteWorker(verifier.address, "verifier")
    try:
        with pytest.raises(grpc.RpcError) as error:
            list(worker.stub.Decode(pb.DecodeRequest(**request), timeout=10))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and error.value.details()
        assert len(list(worker.stub.Decode(pb.DecodeRequest(session_id="ok", context=_ctx([1, 2]), max_tokens=3),
                                           timeout=10))) == 3
    finally:
        worker.close()
