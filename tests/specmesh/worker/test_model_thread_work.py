"""Every piece of a worker's torch work runs on its model's thread, never on the gRPC handler thread that took the call.

Why it matters (specmesh/runtime/model_thread.py): a thread that runs a parallel torch op (an argmax over a 150k-wide
vocabulary is one) gets an OpenMP team of its own; with more OpenMP threads than cores libgomp stops spin-waiting, and
every forward pass of the process then runs about 25% slower. These tests call the engines from several threads at
once and record which thread ran the sampling and acceptance steps."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

import drafter.engine
import verifier.engine
from drafter.config import BatchingConfig as DraftBatching
from drafter.engine import DraftEngine
from specmesh.decoding.sampling import SamplingParams
from specmesh.wire.history import EMPTY_HASH
from verifier.config import BatchingConfig as VerifyBatching
from verifier.engine import VerifyEngine


def recording(monkeypatch, module, name: str) -> set[int]:
    """Wrap module.name so that each call records the calling thread's id."""
    threads: set[int] = set()
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        threads.add(threading.get_ident())
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return threads


def model_thread_of(engine) -> int:
    return engine.loaded.run_on_model_thread(threading.get_ident)


@pytest.mark.parametrize("max_batch_size", [1, 4])
def test_verify_accepts_on_the_model_thread(tiny_target, monkeypatch, max_batch_size):
    engine = VerifyEngine(tiny_target, batching=VerifyBatching(max_batch_size=max_batch_size))
    deciders = recording(monkeypatch, verifier.engine, "decide")

    def session(i: int) -> None:
        engine.verify(f"s{i}", 0, EMPTY_HASH, [1, 2, 3 + i], [4, 5], [], SamplingParams(), 0)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(session, range(8)))
    assert deciders == {model_thread_of(engine)}
    assert threading.get_ident() not in deciders


@pytest.mark.parametrize("max_batch_size", [1, 4])
def test_drafts_are_sampled_on_the_model_thread(tiny_target, monkeypatch, max_batch_size):
    engine = DraftEngine(tiny_target, batching=DraftBatching(max_batch_size=max_batch_size))
    samplers = recording(monkeypatch, drafter.engine, "draft_sample")

    def session(i: int) -> None:
        proposal = engine.propose(f"s{i}", 0, EMPTY_HASH, [1, 2, 3 + i], 3, SamplingParams(temperature=0.8), i)
        assert len(proposal.tokens) == 3

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(session, range(8)))
    assert samplers == {model_thread_of(engine)}
