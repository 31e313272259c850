"""The real default pair (Qwen2.5-Coder 0.5B drafting for 1.5B, the GGUFs as shipped) on the ik_llama.cpp engine, in
process: greedy speculative output equals the target's own one-token greedy decoding on every committed benchmark
prompt, for every k from 1 to 8, pipelined and not; and a worker's engine survives many concurrent sessions of very
different lengths, prefills mixed with verifies."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from coordinator.draft_length import DraftLength
from coordinator.loop import LoopConfig, speculative_decode
from drafter.engine import DraftEngine
from specmesh.decoding.sampling import SamplingParams
from specmesh.runtime.catalog import DEFAULT_DRAFT_MODEL, DEFAULT_TARGET_MODEL
from specmesh.runtime.engine import ik_available
from tests.coordinator.test_loop import InProcessDrafter, InProcessTarget
from verifier.engine import VerifyEngine

pytestmark = [pytest.mark.real_models,
              pytest.mark.skipif(not ik_available(), reason="ik_llama.cpp does not load here")]

PROMPTS = json.loads((Path(__file__).parents[1] / "coordinator/benchmarks/prompts.json").read_text())["prompts"]
MAX_NEW = 24


@pytest.fixture(scope="module")
def pair():
    from specmesh.runtime.ik_engine import IkLlamaEngine

    target = IkLlamaEngine.load(DEFAULT_TARGET_MODEL, context_length=2048, max_sessions=8, progress=False)
    draft = IkLlamaEngine.load(DEFAULT_DRAFT_MODEL, context_length=2048, max_sessions=8, progress=False)
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
