"""The real default pair (Qwen2.5-Coder 0.5B drafting for 1.5B: the target's GGUF as shipped, the drafter's requantized
to q4_0 as drafter workers run it) on the ik_llama.cpp engine, in
process: greedy speculative output equals the target's own one-token greedy decoding on every committed benchmark
prompt, for every k from 1 to 8, pipelined and not; a second conversation turn resumed from the prefix cache and
drafted hybrid stays exact; and a worker's engine survives many concurrent sessions of very
different lengths, prefills mixed with verifies."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from coordinator.drafting.policies import DraftLength
from coordinator.loop import LoopConfig, speculative_decode
from drafter.engine import DraftEngine
from specmesh.decoding.sampling import SamplingParams
from specmesh.runtime.catalog import DEFAULT_DRAFT_MODEL, DEFAULT_TARGET_MODEL
from specmesh.runtime.engine import ik_available
from tests.coordinator.test_loop import InProcessDrafter, InProcessTarget
from verifier.engine import VerifyEngine

pytestmark = [pytest.mark.real_models,
              pytest.mark.skipif(not ik_available(), reason="ik_llama.cpp does not load here")]

PROMPTS = json.loads((Path(__file__).parents[1] / "specmesh_bench/prompts.json").read_text())["prompts"]
MAX_NEW = 24


@pytest.fixture(scope="module")
def pair():
    from specmesh.runtime.ik_engine import IkLlamaEngine

    target = IkLlamaEngine.load(DEFAULT_TARGET_MODEL, context_length=2048, max_sessions=8, progress=False)
    # As a drafter worker loads it: one-row passes, and the q4_0 copy of the shipped file (requantize "auto").
    draft = IkLlamaEngine.load(DEFAULT_DRAFT_MODEL, context_length=2048, max_sessions=8, progress=False, exact=False,
                               requantize="auto")
    yield target, draft
    draft.close()
    target.close()


def chat_ids(engine, prompt: str) -> list[int]:
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                add_generation_prompt=True)
    return engine.tokenizer(text, add_special_tokens=False)["input_ids"]


def decode(target, draft, prompt: list[int], k: int, pipeline: bool = False) -> list[int]:
    params = SamplingParams()
    drafter = InProcessDrafter(DraftEngine(draft), prompt, params) if k else None
    return speculative_decode(drafter, InProcessTarget(VerifyEngine(target), prompt, params),
                              LoopConfig(max_new_tokens=MAX_NEW, eos_token_ids=frozenset(target.eos_token_ids),
                                         draft_length=DraftLength.fixed(k), pipeline=pipeline)).tokens


def test_speculative_greedy_equals_one_token_decoding_on_every_committed_prompt(pair):
    """Every prompt once, k cycling through 1..8 and pipelining through off/on: 22 prompts cover every (k, pipeline)
    pair at least once (a full cross product would take 16 generations a prompt)."""
    target, draft = pair
    for i, item in enumerate(PROMPTS):
        prompt = chat_ids(target, item["prompt"])
        k, pipeline = 1 + i % 8, (i // 8) % 2 == 1 if i < 16 else i % 2 == 0
        assert decode(target, draft, prompt, k, pipeline) == decode(target, draft, prompt, 0), \
            f"{item['id']}: k={k}, pipeline={pipeline}"


def _multi_and_one_row_logits(engine, tokens: list[int], prompt_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of the tokens after the prompt: from one pass of them all, and from one-token steps."""
    sequence = engine.new_sequence()
    sequence.logits_for(tokens[:prompt_length], 1)
    stepped = torch.cat([sequence.logits_for(tokens[:i + 1], 1) for i in range(prompt_length, len(tokens))])
    return engine.new_sequence().logits_for(tokens, len(tokens) - prompt_length), stepped


WHEEL_SCRIPT = """
import sys, torch
from specmesh.runtime.catalog import DEFAULT_TARGET_MODEL
from specmesh.runtime.ik_engine import IkLlamaEngine
from tests.test_real_ik import _multi_and_one_row_logits
tokens, prompt_length = eval(sys.argv[1]), int(sys.argv[2])
exact = IkLlamaEngine.load(DEFAULT_TARGET_MODEL, context_length=512, max_sessions=2, progress=False)
one_row = IkLlamaEngine.load(DEFAULT_TARGET_MODEL, context_length=512, max_sessions=2, progress=False, exact=False)
assert not exact.row_invariant and exact.min_pass_rows == 2 and one_row.min_pass_rows == 1, exact.build
torch.save({"exact": _multi_and_one_row_logits(exact, tokens, prompt_length),
            "one_row": _multi_and_one_row_logits(one_row, tokens, prompt_length)[1]}, sys.argv[3])
"""


def test_one_row_steps_are_exact_on_the_row_invariant_build_and_give_the_wheels_tokens(pair, tmp_path):
    """Why the exact engine steps one row: on the row-invariant build (ik_build.py) a one-row pass gives the bits of a
    multi-row pass, for the target as shipped (Q4_K, Q6_K) and the drafter's q4_0 copy. On the wheel's library
    (SPECMESH_IK_BUILD=wheel, another process) one-row passes differ, so its exact engine steps two rows; those steps,
    and its multi-row passes, give the row-invariant build's logits bit for bit: the same tokens, faster."""
    import os
    import subprocess
    import sys

    target, draft = pair
    prompt = chat_ids(target, PROMPTS[0]["prompt"])
    tokens = prompt + list(range(2000, 2016))
    assert target.row_invariant  # the exact engine: checked at load
    for engine in pair:
        assert engine.min_pass_rows == 1 and "row-invariant build" in engine.build, engine.build
        multi, stepped = _multi_and_one_row_logits(engine, tokens, len(prompt))
        assert torch.equal(multi, stepped), engine.build

    out = tmp_path / "wheel.pt"
    env = {**os.environ, "SPECMESH_IK_BUILD": "wheel"}  # IK_LLAMA_CPP_LIB_PATH, set here by the binding, is inherited
    done = subprocess.run([sys.executable, "-c", WHEEL_SCRIPT, repr(tokens), str(len(prompt)), str(out)], env=env,
                          cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    wheel = torch.load(out)
    wheel_multi, wheel_stepped = wheel["exact"]
    assert torch.equal(wheel_multi, wheel_stepped)  # two-row steps: exact on the wheel
    assert not torch.equal(wheel["one_row"], wheel_multi)  # its one-row passes are not
    built_multi, _ = _multi_and_one_row_logits(target, tokens, len(prompt))
    assert torch.equal(wheel_multi, built_multi)


def test_many_concurrent_sessions_of_mixed_lengths_never_crash(pair):
    """The 0.5B model's engine, as a drafter or verifier worker drives it: 12 sessions with prompts of 3 to 700
    tokens, 3 threads calling at once, prefills mixed with short verify-sized passes and rollbacks, more sessions than
    contexts (evictions). Every call answers with rows of the vocabulary's width."""
    _, engine = pair
    rng = random.Random(11)
    sessions = [(engine.new_sequence(), [rng.randrange(100, 150000) for _ in range(rng.choice((3, 60, 300, 700)))])
                for _ in range(12)]

    def work(seed: int) -> int:  # a thread's own 4 sessions: a worker serialises the calls of one session
        local = random.Random(seed)
        done = 0
        for _ in range(8):
            sequence, tokens = sessions[seed * 4 + local.randrange(4)]
            request = tokens + [local.randrange(100, 150000) for _ in range(local.randint(1, 9))]
            last_n = local.randint(1, min(9, len(request)))
            rows = engine.batched_logits([sequence], [request], [last_n])[0]
            assert rows.shape == (last_n, engine.vocab_size)
            sequence.rollback(local.randint(0, len(sequence.cached_tokens)))
            done += 1
        return done

    assert len(sessions) > engine.max_contexts
    with ThreadPoolExecutor(3) as pool:
        assert sum(pool.map(work, range(3))) == 24


def conversation_turn(engine, messages: list[dict]) -> list[int]:
    text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return engine.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_second_turn_resumes_from_the_prefix_cache_and_hybrid_drafts_stay_exact(pair):
    """Two turns of a conversation on the real pair: turn 2 starts from turn 1's cells (prefix cache hit, at least
    turn 1's prompt reused) and, drafted hybrid (a suffix drafter first, the draft model elsewhere), gives exactly the
    tokens a target without any cache or drafts gives; the suffix drafter, having seen turn 1's answer, drafts the
    part of turn 2's answer that repeats it."""
    from coordinator.drafting.hybrid import HybridDraftSource
    from drafter.ngram import ngram_description
    from drafter.suffix import SuffixEngine
    from specmesh.runtime.ik_engine import IkLlamaEngine
    from specmesh.wire.history import EMPTY_HASH

    target, draft = pair
    params = SamplingParams()
    suffix = SuffixEngine(ngram_description(target.name, target.vocab_size, target.eos_token_ids, target.fingerprint,
                                            target.context_limit))
    question = [{"role": "user", "content": "Write a Python function is_even(n) that returns True for even n."}]
    turn1 = conversation_turn(target, question)
    answer = decode(target, draft, turn1, 0)
    suffix.propose("turn-1", 0, EMPTY_HASH, [*turn1, *answer], 1, params, 0)
    suffix.end_session("turn-1")  # the finished request goes into the global tree
    turn2 = conversation_turn(target, [*question, {"role": "assistant", "content": target.tokenizer.decode(answer)},
                                       {"role": "user", "content": "Repeat the same function, unchanged."}])
    hits, reused = target.prefix_hits, target.prefix_reused_tokens
    config = LoopConfig(max_new_tokens=MAX_NEW, eos_token_ids=frozenset(target.eos_token_ids),
                        draft_length=DraftLength.fixed(4))
    hybrid = HybridDraftSource(InProcessDrafter(suffix, turn2, params), InProcessDrafter(DraftEngine(draft), turn2,
                                                                                         params))
    result = speculative_decode(hybrid, InProcessTarget(VerifyEngine(target), turn2, params), config)
    assert target.prefix_hits > hits and target.prefix_reused_tokens - reused >= len(turn1) - 1
    fresh = IkLlamaEngine.load(DEFAULT_TARGET_MODEL, context_length=2048, max_sessions=1, progress=False,
                               prefix_cache=False)
    try:
        assert result.tokens == decode(fresh, draft, turn2, 0)
    finally:
        fresh.close()
    assert hybrid.suffix_rounds > 0, (hybrid.suffix_rounds, hybrid.model_rounds)


def test_a_stream_guesses_only_where_its_step_has_a_spare_row_and_keeps_the_target_s_own_tokens(pair):
    """On the wheel's library the exact target's one-token step runs two rows, and a Decode stream asked to guess
    puts a guess of the next token in the second (tests/test_ik_services.py runs that on a real wheel verifier). On
    the row-invariant build a step is one row, so a guess would cost a second: the stream does not guess. On two
    committed code prompts, 48 tokens each, the tokens equal the target's own one-token greedy decoding."""
    from specmesh.wire.history import EMPTY_HASH
    from verifier.decode_stream import DecodeSteps, decode_stream

    target, draft = pair
    verifier = VerifyEngine(target)
    assert verifier.guesses_are_free == (not target.row_invariant)
    stops = frozenset(target.eos_token_ids)
    right = steps = guesses = 0
    for item in [p for p in PROMPTS if p["class"] == "code"][:2]:
        prompt = chat_ids(target, item["prompt"])
        asked = DecodeSteps(item["id"], 0, EMPTY_HASH, tuple(prompt), 48, stops, SamplingParams(), 0, guess=True)
        outcomes = [o for m in decode_stream(verifier, asked, lambda: True, lambda: None) for o in m]
        verifier.end_session(item["id"])
        tokens = [t for o in outcomes for t in o.committed]
        # The target's own greedy decoding: one Verify call without drafts a token (no stream, no guesses).
        with_k0 = speculative_decode(None, InProcessTarget(verifier, prompt, SamplingParams()),
                                     LoopConfig(max_new_tokens=48, eos_token_ids=stops,
                                                draft_length=DraftLength.fixed(0))).tokens
        assert tokens == with_k0, item["id"]
        right += sum(len(o.accepted_guesses) for o in outcomes)
        guesses += sum(o.guesses for o in outcomes)
        steps += len(outcomes)
    if target.row_invariant:
        assert guesses == 0 and steps == 96
    else:
        assert right > 0, f"no right guess in {steps} steps"


def test_a_started_verifier_serves_its_first_session_from_a_spare_context(pair):
    """The verifier's warm-up leaves a spare context, and the first request's prompt (no cached prefix: the warm-up's
    cells hold the cost probe's context) binds it: no context (4096 cells cleared, 1.3-1.8 s on a 2-core VM
    whose memory faults in slowly) is made before the first token; greedy output stays what the target gives."""
    from specmesh.runtime.ik_engine import IkLlamaEngine

    target, draft = pair
    started = IkLlamaEngine.load(DEFAULT_TARGET_MODEL, context_length=4096, max_sessions=4, progress=False)
    verifier = VerifyEngine(started)
    try:
        verifier.warm_up()  # a worker reports SERVING after it
        contexts = len(started._contexts)
        prompt = chat_ids(started, PROMPTS[0]["prompt"])
        params = SamplingParams()
        tokens = speculative_decode(None, InProcessTarget(verifier, prompt, params),
                                    LoopConfig(max_new_tokens=8, eos_token_ids=frozenset(started.eos_token_ids),
                                               draft_length=DraftLength.fixed(0))).tokens
        assert len(started._contexts) == contexts
        assert tokens == decode(target, draft, prompt, 0)[:len(tokens)]
    finally:
        verifier.stop_background_work()
        started.close()


def test_make_run_measures_the_costs_once_for_the_runs_after_it(tmp_path):
    """`coordinator generate` on its own local workers, on a machine with no cached costs: after the answer it waits
    for the workers to measure their costs; the next run starts its cost policy from them (cached) instead of
    drafting off for want of costs, and waits for nothing."""
    import os
    import subprocess
    import sys

    from specmesh.runtime.catalog import cache_dir

    for shared in ("models", "converted", "wheels"):  # the models and tokenizers as cached; no costs
        if (cache_dir() / shared).exists():
            (tmp_path / shared).symlink_to(cache_dir() / shared)
    env = {**os.environ, "SPECMESH_CACHE_DIR": str(tmp_path)}
    env.pop("SPECMESH_COST_CACHE", None)

    def generate() -> tuple[dict, str]:
        run = subprocess.run([sys.executable, "-m", "coordinator", "generate", "--prompt", PROMPTS[0]["prompt"],
                              "--max-new-tokens", "4", "--json"], capture_output=True, text=True, timeout=600,
                             env=env)
        assert run.returncode == 0, run.stderr
        return json.loads(run.stdout), run.stderr

    first, said = generate()
    assert "the workers have not measured their costs yet" in first["stats"]["draft_note"]
    assert "costs measured in" in said, said
    assert len(list((tmp_path / "costs").glob("*.json"))) == 2  # the verifier's and the drafter's
    second, said = generate()
    assert "not measured" not in (second["stats"].get("draft_note") or "")
    assert "measure their costs" not in said
    assert second["token_ids"] == first["token_ids"]


def test_the_next_coordinator_generate_starts_from_what_the_last_one_learned_of_the_workers(tmp_path):
    """Two `coordinator generate` runs on the default hybrid, the learning cache on (as outside the tests): the first
    keeps what its generation measured of the workers (its streamed tokens' price; the model's overhead where its
    rounds measured it) in a file for this set of workers; the second starts its generation from it (stats'
    `learned`), and its tokens are the same."""
    import os
    import subprocess
    import sys

    from specmesh.runtime.catalog import cache_dir

    for shared in ("models", "converted", "wheels", "requantized", "engines", "costs"):  # all but what was learned
        if (cache_dir() / shared).exists():
            (tmp_path / shared).symlink_to(cache_dir() / shared)
    env = {**os.environ, "SPECMESH_CACHE_DIR": str(tmp_path), "SPECMESH_LEARNING_CACHE": "1"}
    env.pop("SPECMESH_COST_CACHE", None)

    def generate() -> dict:
        run = subprocess.run([sys.executable, "-m", "coordinator", "generate", "--prompt", PROMPTS[0]["prompt"],
                              "--max-new-tokens", "48", "--json"], capture_output=True, text=True, timeout=600,
                             env=env)
        assert run.returncode == 0, run.stderr
        return json.loads(run.stdout)

    first = generate()
    if "not measured" in (first["stats"].get("draft_note") or ""):  # a machine with no cached costs: now measured
        first = generate()
    stored = list((tmp_path / "learned").glob("*.json"))
    assert len(stored) == 1, stored
    entries = json.loads(stored[0].read_text())["entries"]
    assert "streamed" in entries and 0.25 <= entries["streamed"]["value"] <= 4.0, entries
    second = generate()
    learned = second["stats"].get("learned", {})
    assert learned.get("streamed") == pytest.approx(entries["streamed"]["value"], rel=1e-4), (learned, entries)
    assert second["token_ids"] == first["token_ids"]


def test_a_model_session_whose_opening_cannot_pay_is_never_opened_and_the_output_stays_exact(pair):
    """The hybrid's opening gate on the real pair: a 390-token document question, its answer's budget too small for
    the draft model's savings to repay prefilling its window (about 1 s on 2 cores), leaves the model's session
    unopened; a budget that can repay it opens it; a second generation over the same window prefills only what the
    drafter does not hold from the first (the coordinator's mirror). Greedy output equals the target's own either way."""
    from coordinator.drafting.costs import CostEstimate
    from coordinator.drafting.hybrid import HybridDraftSource
    from coordinator.fleet.drafter_prefixes import DrafterPrefixes
    from coordinator.fleet.remote_sessions import LazyDraftSource
    from coordinator.loop import Draft

    class NoSuffixDrafts:
        def propose(self, k, after=()):
            return Draft()

        def update(self, committed):
            pass

    target, draft = pair
    params = SamplingParams()
    document = " ".join(f"Clause {n}. The tenant pays {n * 100} euros for service {n}, invoiced each quarter and "
                        f"reconciled each January." for n in range(1, 13))
    prompt = chat_ids(target, f"{document}\n\nWhat does clause 7 say? Quote it.")
    assert 300 <= len(prompt) < 512
    # The real pair's costs (2-core Zen 4): a drafted token 11 ms, the 1.5B step 45 ms; a prefilled token 2.8 ms.
    costs = CostEstimate(0.8, 0.0114, 0.0453, 0.0, verify_curve=((0, 0.0453), (1, 0.0456), (4, 0.0764), (8, 0.145)),
                         target_streams=True)
    prefixes = DrafterPrefixes()
    expected = decode(target, draft, prompt, 0)

    def generate(budget: int) -> tuple[list[int], LazyDraftSource, HybridDraftSource]:
        model = LazyDraftSource(prompt, lambda history: InProcessDrafter(DraftEngine(draft), history, params),
                                window=256, prefixes=prefixes)
        hybrid = HybridDraftSource(NoSuffixDrafts(), model, model_costs=costs, timed=False, token_budget=budget,
                                   opening_s_per_token=0.0028)
        config = LoopConfig(max_new_tokens=MAX_NEW, eos_token_ids=frozenset(target.eos_token_ids),
                            draft_length=DraftLength.fixed(4))
        tokens = speculative_decode(hybrid, InProcessTarget(VerifyEngine(target), prompt, params), config).tokens
        return tokens, model, hybrid
    tokens, model, hybrid = generate(MAX_NEW)
    assert tokens == expected
    assert model.source is None and hybrid.model_rounds == 0 and hybrid.openings_declined > 0
    tokens, model, hybrid = generate(4096)  # a budget the savings could repay: it opens
    assert tokens == expected and model.source is not None and hybrid.model_rounds > 0
    assert LazyDraftSource(prompt, lambda history: None, window=256, prefixes=prefixes).opening_tokens() == 0, \
        "the drafter holds this window now"
