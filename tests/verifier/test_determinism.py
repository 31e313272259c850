"""The same request gets the same answer whatever else runs: greedy and seeded generations through a verifier and a
drafter with their default options (tiny models in bfloat16 and float32), each alone and then among concurrent
others in another order, repeat token for token; the repeats resume from the prefix cache."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from coordinator import Coordinator, GenerationOptions
from drafter.service import run_server as run_drafter
from specmesh.runtime.models import load_model
from verifier.service import run_server as run_verifier

TEXTS = ("def fibonacci(n):", "Once upon a time", "SELECT * FROM", "import numpy as np\n", "hello world",
         "class Stack:", "The quick brown fox", "for i in range(10):")
MAX_NEW = 24


def requests() -> list[tuple[str, GenerationOptions]]:
    """Greedy (adaptive and fixed draft lengths, target-only) and seeded sampling (a fixed draft length: which
    positions carry drafts decides which sample a seed gives)."""
    out = []
    for i, text in enumerate(TEXTS):
        out.append((text, GenerationOptions(max_new_tokens=MAX_NEW, chat=False, draft_tokens=(None, 0, 3, 6)[i % 4])))
        out.append((text, GenerationOptions(max_new_tokens=MAX_NEW, chat=False, draft_tokens=(2, 4)[i % 2],
                                            temperature=0.9, top_p=0.95, seed=100 + i)))
    return out


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_answers_repeat_alone_and_under_concurrent_load(dtype):
    target = load_model("tiny-random-qwen2", device="cpu", dtype=dtype, progress=False)
    draft = load_model("tiny-random-qwen2-b", device="cpu", dtype=dtype, progress=False)
    work = requests()
    with run_verifier(target, port=0, max_batch_wait_s=0.05) as verifier, \
            run_drafter(draft, port=0, max_batch_wait_s=0.05) as drafter, \
            Coordinator(verifier=verifier.address, drafter=drafter.address, tokenizer=target.tokenizer) as c:
        def answer(i: int) -> list[int]:
            return c.generate(work[i][0], work[i][1]).token_ids

        alone = [answer(i) for i in range(len(work))]
        for seed in (1, 2):
            order = list(range(len(work)))
            random.Random(seed).shuffle(order)
            with ThreadPoolExecutor(8) as pool:
                loaded = dict(zip(order, pool.map(answer, order)))
            differ = [i for i in range(len(work)) if loaded[i] != alone[i]]
            assert not differ, f"{len(differ)} of {len(work)} answers changed under load: requests {differ}"
        assert verifier.engine.loaded.prefix_hits > 0  # the repeats resumed from the prefix cache
