"""The n-gram (prompt lookup) drafter: the lookup itself, its engine, and a real gRPC ngram drafter + verifier on tiny
models (float64) whose output must equal the target's own greedy decoding."""

from __future__ import annotations

import logging

import grpc
import prometheus_client
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import specmesh.worker.config
from coordinator import Coordinator, GenerationOptions
from coordinator.fleet.local_workers import LocalWorkerSpec, local_workers
from coordinator.fleet.worker_client import RemoteWorker
from drafter.cli import main as drafter_main
from drafter.ngram import NO_DTYPE, NgramEngine, describe_loaded, describe_target
from specmesh.decoding.prompt_lookup import NgramConfig, NgramIndex, continue_from, lookup
from drafter.service import run_server as run_drafter
from specmesh.wire.history import EMPTY_HASH, ResyncRequired, TokenHistory, history_hash
from specmesh.decoding.sampling import SamplingParams, SparseDist
from specmesh.wire.contract import Cancelled
from specmesh.v1 import specmesh_pb2 as pb
from tests.helpers import reference_greedy, wait_for_costs
from verifier.cli import main as verifier_main
from verifier.service import run_server as run_verifier

MAX_NEW = 40
GREEDY = SamplingParams()


# ---- the lookup ----

@pytest.mark.parametrize("tokens, k, expected", [
    ([1, 2, 3, 4, 1, 2], 3, [3, 4, 1]),          # trigram absent, bigram (1, 2) matches: copy what followed
    ([1, 2, 3, 4, 1, 2], 1, [3]),                # at most k
    ([7, 1, 2, 9, 5, 1, 2, 8, 3, 1, 2], 2, [8, 3]),  # the most recent earlier occurrence wins
    ([1, 2, 3, 9, 2, 3, 8, 1, 2, 3], 1, [9]),    # the longest n wins over a more recent shorter match
    ([1, 2, 3], 4, []),                          # nothing repeats: no proposal
    ([5], 4, []),                                # a single token has no earlier occurrence
    ([5, 5, 5, 5], 4, [5, 5, 5, 5]),             # overlapping match, copied on periodically
    ([1, 2, 1, 2], 5, [1, 2, 1, 2, 1]),          # period 2 continued past the end of the history
    ([1, 2, 3, 1, 2], 0, []),
])
def test_lookup_examples(tokens, k, expected):
    assert lookup(tokens, k) == expected
    index = NgramIndex()
    index.update(TokenHistory(tokens))
    assert index.propose(tokens, k) == expected


def test_ngram_bounds_limit_the_match():
    tokens = [4, 1, 2, 3, 9, 8, 1, 2, 3]  # only (3,) (2, 3) (1, 2, 3) repeat
    assert lookup(tokens, 2, min_ngram=1, max_ngram=3) == [9, 8]
    assert lookup([1, 2, 9, 3, 2], 2, min_ngram=2, max_ngram=3) == []  # only a unigram repeats
    assert lookup([1, 2, 9, 3, 2], 2, min_ngram=1, max_ngram=1) == [9, 3]
    for bad in ((0, 3), (3, 2)):
        with pytest.raises(ValueError):
            NgramConfig(*bad)


def test_continue_from_runs_through_its_own_copy():
    assert continue_from([7, 8, 9], 1, 5) == [8, 9, 8, 9, 8]
    assert continue_from([7, 8, 9], 0, 2) == [7, 8]


@settings(max_examples=150, deadline=None)
@given(chunks=st.lists(st.tuples(st.integers(0, 30), st.lists(st.integers(0, 3), max_size=12)), min_size=1,
                       max_size=8),
       k=st.integers(1, 6), bounds=st.sampled_from([(1, 3), (2, 4), (1, 1), (3, 3)]))
def test_incremental_index_equals_the_linear_scan(chunks, k, bounds):
    """Grow a history by syncs that sometimes build on a shorter prefix (truncation): the index stays exact."""
    config = NgramConfig(*bounds)
    history, index = TokenHistory(), NgramIndex(config)
    for keep, new in chunks:
        base = min(keep, len(history))
        history.apply_sync(base, history.hash_at(base), new)
        index.update(history)
        assert index.propose(history.tokens, k) == lookup(history.tokens, k, *bounds)


# ---- the engine ----

@pytest.fixture(scope="module")
def info(tiny_target):
    return describe_loaded(tiny_target)


def test_engine_greedy_and_sampled_proposals(info):
    engine = NgramEngine(info)
    prompt = [10, 11, 12, 13, 10, 11]
    greedy = engine.propose("a", 0, EMPTY_HASH, prompt, 3, GREEDY, 0)
    assert greedy.tokens == (12, 13, 10) and greedy.dists == () and greedy.committed_length == 6
    sampled = engine.propose("b", 0, EMPTY_HASH, prompt, 2, SamplingParams(temperature=0.8, top_p=0.9), 5)
    assert sampled.tokens == (12, 13)
    assert sampled.dists == (SparseDist((12,), (1.0,)), SparseDist((13,), (1.0,)))  # a point mass per token
    assert engine.propose("c", 0, EMPTY_HASH, [1, 2, 3], 4, GREEDY, 0).tokens == ()  # no match: empty proposal
    assert len(engine.sessions) == 3
    assert engine.sessions.end("a") and not engine.sessions.end("a")
    assert len(engine.sessions) == 2


def test_engine_follows_incremental_syncs_and_retries(info):
    engine = NgramEngine(info)
    engine.propose("s", 0, EMPTY_HASH, [1, 2, 3], 2, GREEDY, 0)
    history = [1, 2, 3, 4, 1, 2]
    # Incremental: build on the 3 tokens the server holds.
    assert engine.propose("s", 3, history_hash([1, 2, 3]), [4, 1, 2], 2, GREEDY, 0).tokens == (3, 4)
    # A retry building on a shorter prefix (2 tokens) with other tokens: the history is truncated, the index rebuilt.
    assert engine.propose("s", 2, history_hash([1, 2]), [5, 1, 2], 2, GREEDY, 0).tokens == (5, 1)
    with pytest.raises(ResyncRequired):
        engine.propose("s", 6, history_hash(history), [7], 2, GREEDY, 0)  # the server holds another history
    with pytest.raises(ResyncRequired):
        engine.propose("unknown", 3, history_hash([1, 2, 3]), [1], 2, GREEDY, 0)
    with pytest.raises(Cancelled):
        engine.propose("s", 0, EMPTY_HASH, [1], 2, GREEDY, 0, is_active=lambda: False)


def test_info_from_the_tokenizer_alone_matches_the_loaded_target(tiny_target):
    info = describe_target("tiny-random-qwen2")
    assert (info.engine, info.dtype, info.weights_bytes) == ("", NO_DTYPE, 0)  # no model runs
    assert info.vocab_size == tiny_target.vocab_size  # the padded logits width, not len(tokenizer)
    assert info.vocab_size > len(tiny_target.tokenizer)
    assert info.fingerprint == tiny_target.fingerprint
    assert info.eos_token_ids == tiny_target.eos_token_ids
    assert info.context_limit == tiny_target.model.config.max_position_embeddings
    assert info == describe_loaded(tiny_target)
    assert describe_target("tiny-random-qwen2", vocab_size=300).vocab_size == 300


# ---- real gRPC services ----

# A repetitive prompt on which the tiny random target also repeats itself (runs of one token, short cycles), as real
# models do when quoting: n-gram drafts get accepted. (Found by trying prompts; float64 makes it deterministic.)
REPETITIVE = "a" * 20


@pytest.fixture(scope="module")
def verifier(tiny_target):
    with run_verifier(tiny_target, port=0) as server:
        wait_for_costs(server.address, "verifier")  # the cost prior of every generation (seeded runs repeat with it)
        yield server


def _no_weights(*args, **kwargs):
    raise AssertionError("the ngram drafter must not load model weights")


@pytest.fixture(scope="module")
def ngram_drafter():
    # Built from the model *name*: only the tokenizer is read; loading weights here would be a bug.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(specmesh.worker.config, "load_engine", _no_weights)
        with run_drafter("tiny-random-qwen2", port=0, method="ngram") as server:
            yield server


def generate(verifier, drafter, tokenizer, prompt, **options):
    # The heuristic keeps drafting: the default cost policy decides from the verifier's warm-up timings, which on a
    # busy machine can say that drafting does not pay, and then these tests would see no drafts at all.
    with Coordinator(verifier=verifier.address, drafter=drafter.address, tokenizer=tokenizer) as c:
        return c.generate(list(prompt), GenerationOptions(max_new_tokens=MAX_NEW, draft_policy="heuristic",
                                                          **options))


@pytest.mark.parametrize("k", [None, 2, 5])
def test_ngram_drafter_gives_target_only_greedy_output(verifier, ngram_drafter, tiny_target, k):
    prompt = tiny_target.tokenizer(REPETITIVE)["input_ids"]
    expected = reference_greedy(tiny_target.model, prompt, MAX_NEW, set(tiny_target.eos_token_ids))
    result = generate(verifier, ngram_drafter, tiny_target.tokenizer, prompt, draft_tokens=k)
    assert result.token_ids == expected
    assert result.stats["drafted_tokens"] > 0
    assert result.stats["acceptance_rate"] > 0  # some drafts were right: fewer rounds than tokens
    assert result.stats["rounds"] < len(expected)
    if k is not None:
        # Drafts shorter than k (including none at all) happen and the loop takes them as they are.
        assert any(r.drafted < min(k, MAX_NEW - 1) for r in result.rounds)


def test_ngram_drafter_sampling_is_seeded_and_valid(verifier, ngram_drafter, tiny_target):
    prompt = tiny_target.tokenizer(REPETITIVE)["input_ids"]
    runs = [generate(verifier, ngram_drafter, tiny_target.tokenizer, prompt, temperature=0.7, seed=seed)
            for seed in (3, 3)]
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].stats["drafted_tokens"] > 0  # point-mass distributions passed the verifier's validation
    assert runs[0].stats["degraded_rounds"] == 0


def test_ngram_drafter_info_and_empty_proposal(ngram_drafter, tiny_target):
    worker = RemoteWorker(ngram_drafter.address, "drafter")
    try:
        info = worker.info()
        assert (info.model_name, info.vocab_size, info.tokenizer_fingerprint, info.dtype, info.role) == (
            "tiny-random-qwen2", tiny_target.vocab_size, tiny_target.fingerprint, "none", "drafter")
        reply = worker.stub.Propose(pb.ProposeRequest(session_id="s", num_tokens=4, context=pb.ContextSync(
            base_length=0, base_hash=EMPTY_HASH, new_tokens=[1, 2, 3])), timeout=10)
        assert list(reply.tokens) == [] and reply.committed_length == 3
        with pytest.raises(grpc.RpcError) as error:  # inputs are validated as for the model drafter
            worker.stub.Propose(pb.ProposeRequest(session_id="t", num_tokens=2, context=pb.ContextSync(
                base_length=0, base_hash=EMPTY_HASH, new_tokens=[1, 10**6])), timeout=10)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        worker.close()
    # The worker's scrape-time gauges are registered as for a model drafter (no KV cache: 0 bytes).
    scraped = prometheus_client.generate_latest().decode()
    assert 'specmesh_kv_cache_bytes{role="drafter"} 0.0' in scraped


def test_ngram_drafter_with_another_tokenizer_drafts_through_text(verifier, tiny_target):
    """Prompt lookup over another tokenizer's ids: the drafts are translated through text (coordinator/translation.py),
    and still give the target's own output."""
    prompt = tiny_target.tokenizer(REPETITIVE)["input_ids"]
    expected = reference_greedy(tiny_target.model, prompt, MAX_NEW, set(tiny_target.eos_token_ids))
    with run_drafter("tiny-random-llama", port=0, method="ngram") as other:
        result = generate(verifier, other, tiny_target.tokenizer, prompt)
    assert result.token_ids == expected
    assert result.stats["draft_tokenizer"] == "translated"
    assert result.stats["acceptance_rate"] > 0


# ---- the CLI ----

def test_drafter_cli_serves_ngram(tiny_target):
    spec = LocalWorkerSpec("drafter", "tiny-random-qwen2", "cpu", "float64",
                           extra_args=("--method", "ngram", "--ngram-max", "4"))
    with local_workers([spec], progress=False) as addresses:
        worker = RemoteWorker(addresses["drafter"], "drafter")
        try:
            info = worker.info()
        finally:
            worker.close()
    assert info.vocab_size == tiny_target.vocab_size and info.tokenizer_fingerprint == tiny_target.fingerprint


@pytest.mark.parametrize("main, args, message", [
    (verifier_main, ["--method", "ngram"], "unrecognized arguments"),
    (drafter_main, ["--vocab-size", "100"], "only apply to the ngram method"),
    (drafter_main, ["--method", "ngram", "--ngram-min", "3", "--ngram-max", "2"], "min_ngram"),
    (drafter_main, ["--method", "beam"], "invalid choice"),
])
def test_cli_refuses_bad_method_options(main, args, message, capsys):
    handlers = logging.root.handlers[:]  # serve_main's logging.basicConfig would leave a handler on capsys' stream
    try:
        status = main(["serve", "--model", "tiny-random-qwen2", "--port", "0", *args])
    except SystemExit as e:  # argparse's own errors
        status = e.code
    finally:
        logging.root.handlers[:] = handlers
    assert status == 2
    assert message in capsys.readouterr().err
