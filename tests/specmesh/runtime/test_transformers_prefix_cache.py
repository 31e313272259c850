"""Prefix caching on the transformers engine (tiny float64 model): a new session resumes from a finished session's
keys/values and gets exactly the logits of a fresh prefill; partial hits, bounds and the off switch."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from coordinator.fleet.polling import wait_until
from specmesh.runtime import transformers_engine
from specmesh.runtime.transformers_engine import TransformersEngine


@pytest.fixture
def engine(tiny_target):
    return TransformersEngine(tiny_target)


def fresh_logits(tiny_target, tokens, last_n):
    return TransformersEngine(tiny_target, prefix_cache=False).new_sequence().logits_for(tokens, last_n)


def end_session(engine, tokens):
    sequence = engine.new_sequence()
    sequence.logits_for(tokens, 1)
    gone = weakref.ref(sequence)
    del sequence
    # The model thread may still hold the call's arguments for a moment after answering: wait for the session to end.
    assert wait_until(lambda: gc.collect() is not None and gone() is None, 5.0)


def test_a_new_session_resumes_from_a_finished_one_exactly(engine, tiny_target):
    turn1 = list(range(10, 60))
    turn2 = turn1 + list(range(100, 112))
    end_session(engine, turn1)
    assert engine.cached_prefixes() == [turn1]
    second = engine.new_sequence()
    assert torch.equal(second.logits_for(turn2, 4), fresh_logits(tiny_target, turn2, 4))
    assert engine.prefix_hits == 1 and engine.prefix_reused_tokens == len(turn1)
    # The entry is copied, not taken: a third session with the same prefix resumes from it too, and batched as well.
    third, fourth = engine.new_sequence(), engine.new_sequence()
    other = turn1[:30] + [7, 8, 9]
    got = engine.batched_logits([third, fourth], [turn2, other], [2, 3])
    # (a batched pass rounds like differently shaped matmuls do: verifier/test_batching.py's tolerance)
    torch.testing.assert_close(got[0], fresh_logits(tiny_target, turn2, 2), rtol=0, atol=1e-10)
    torch.testing.assert_close(got[1], fresh_logits(tiny_target, other, 3), rtol=0, atol=1e-10)  # 30 tokens of 50
    assert engine.prefix_hits == 3 and engine.prefix_reused_tokens == len(turn1) * 2 + 30


def test_a_session_never_reuses_the_positions_whose_logits_it_asks_for(engine, tiny_target):
    tokens = list(range(10, 40))
    end_session(engine, tokens)
    assert torch.equal(engine.new_sequence().logits_for(tokens, 5), fresh_logits(tiny_target, tokens, 5))
    assert engine.prefix_reused_tokens == len(tokens) - 5


def test_the_prefix_cache_is_bounded_least_recently_used_first(engine, monkeypatch):
    monkeypatch.setattr(transformers_engine, "PREFIX_CACHE_MAX_ENTRIES", 3)
    for start in range(0, 250, 50):
        end_session(engine, list(range(start, start + 20)))
    assert [tokens[0] for tokens in engine.cached_prefixes()] == [100, 150, 200]
    engine.new_sequence().logits_for(list(range(100, 130)), 1)  # resuming refreshes the entry it resumed from
    end_session(engine, list(range(260, 280)))
    assert [(tokens[0], len(tokens)) for tokens in engine.cached_prefixes()] == [(100, 20), (100, 30), (260, 20)]
    monkeypatch.setattr(transformers_engine, "PREFIX_CACHE_MAX_BYTES", 1)
    end_session(engine, list(range(280, 290)))
    assert engine.cached_prefixes() == []


def test_without_the_prefix_cache_nothing_is_kept(tiny_target):
    engine = TransformersEngine(tiny_target, prefix_cache=False)
    end_session(engine, list(range(10, 40)))
    engine.new_sequence().logits_for(list(range(10, 45)), 1)
    assert engine.prefix_hits == 0 and engine.cached_prefixes() == []
