"""Deterministic passes on the transformers engine, as a worker loads it by default (tiny models in bfloat16, where
rounding differences flip choices, and float32): a session's logits are the same bits whatever other sessions share
the engine, however its tokens were split into passes, after a prefix-cache resume and after a failover rebuild."""

from __future__ import annotations

import gc
import random
import weakref

import pytest
import torch

from coordinator.fleet.polling import wait_until
from specmesh.runtime.fixed_chunks import CHUNK_TOKENS, ChunkedSequence
from specmesh.runtime.models import load_model
from specmesh.worker.config import ModelConfig, ServerConfig


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def tiny(request):
    return load_model("tiny-random-qwen2", device="cpu", dtype=request.param, progress=False)


def worker_engine(tiny, **options):
    """The engine a worker serving `tiny` runs, with the workers' default options unless given."""
    return ModelConfig(tiny.name, **options).load(ServerConfig(), preloaded=tiny)


def one_token_at_a_time(engine, tokens: list[int]) -> torch.Tensor:
    sequence = engine.new_sequence()
    return torch.cat([sequence.logits_for(tokens[:i + 1], 1) for i in range(len(tokens))])


def verify_steps(engine, tokens: list[int], others: list[list[int]], rng: random.Random) -> torch.Tensor:
    """The logits of every position of `tokens` as a verifier computes them under load: a prompt, then steps of a few
    positions (drafts, some rejected and recomputed), each step in the passes the engine makes of it together with
    other sessions' steps (at most max_batch_size sessions a pass, as verifier/engine.py groups them)."""
    mine, theirs = engine.new_sequence(), [engine.new_sequence() for _ in others]
    done, rows = 0, {}
    while done < len(tokens):
        step = min(len(tokens) - done, rng.choice([1, 2, 3, 5, 9, 23]))
        requests = [(mine, tokens[:done + step], step)]
        for sequence, other in zip(theirs, others):
            cut = rng.randrange(1, len(other) + 1)
            requests.append((sequence, other[:cut], rng.randrange(1, cut + 1)))
        rng.shuffle(requests)
        for at in range(0, len(requests), engine.max_batch_size):
            group = requests[at:at + engine.max_batch_size]
            logits = engine.batched_logits(*map(list, zip(*group)))
            for (sequence, request, last_n), got in zip(group, logits):
                if sequence is mine:
                    for i in range(last_n):
                        rows.setdefault(len(request) - last_n + i, got[i])
        rejected = rng.randrange(0, step) if step > 1 else 0  # a verifier keeps the accepted drafts' keys only
        mine.rollback(done + step - rejected)
        done += step - rejected
    return torch.stack([rows[i] for i in range(len(tokens))])


def test_a_positions_logits_do_not_depend_on_how_its_tokens_were_split(tiny):
    tokens = random.Random(1).choices(range(300), k=3 * CHUNK_TOKENS + 5)
    want = one_token_at_a_time(worker_engine(tiny), tokens)
    for splits in ([len(tokens)], [CHUNK_TOKENS + 3, len(tokens) - CHUNK_TOKENS - 3], [7] * 7 + [4]):
        sequence, done, got = ChunkedSequence(tiny.model), 0, []
        for n in splits:
            got.append(sequence.logits_for(tokens[:done + n], n))
            done += n
        assert torch.equal(torch.cat(got), want), splits


def test_a_sessions_logits_do_not_depend_on_the_other_sessions(tiny):
    rng = random.Random(2)
    tokens = rng.choices(range(300), k=60)
    others = [rng.choices(range(300), k=rng.randrange(5, 80)) for _ in range(5)]
    engine = worker_engine(tiny)
    want = one_token_at_a_time(engine, tokens)
    for seed in range(3):
        assert torch.equal(verify_steps(engine, tokens, others, random.Random(seed)), want), f"load {seed}"


def test_a_prefix_cache_resume_and_a_failover_rebuild_give_the_same_logits(tiny):
    rng = random.Random(3)
    turn1 = rng.choices(range(300), k=37)
    turn2 = turn1 + rng.choices(range(300), k=11)
    want = one_token_at_a_time(worker_engine(tiny), turn2)[-8:]
    engine = worker_engine(tiny)
    first = engine.new_sequence()
    first.logits_for(turn1, 1)
    gone = weakref.ref(first)
    del first  # the finished session's keys/values become a prefix-cache entry
    assert wait_until(lambda: gc.collect() is not None and gone() is None, 5.0)
    resumed = engine.new_sequence()
    assert torch.equal(resumed.logits_for(turn2, 8), want)
    assert engine.prefix_hits == 1 and engine.prefix_reused_tokens == len(turn1)
    # Failover: another verifier rebuilds the session from its whole history in one request.
    assert torch.equal(worker_engine(tiny).new_sequence().logits_for(turn2, 8), want)


def test_without_deterministic_sessions_share_passes(tiny):
    """The fast mode batches sessions (and so their answers may vary with the load in bfloat16)."""
    assert worker_engine(tiny, deterministic=False).max_batch_size > 1
    assert worker_engine(tiny).max_batch_size > 1  # chunks share passes here: checked at load to round alike


def test_the_llamacpp_engine_refuses_deterministic(tmp_path):
    from specmesh.runtime.engine import NO_DETERMINISTIC_LLAMACPP, load_engine

    with pytest.raises(ValueError) as refused:
        load_engine(str(tmp_path / "model.gguf"), engine="llamacpp", deterministic=True)
    assert str(refused.value) == NO_DETERMINISTIC_LLAMACPP
