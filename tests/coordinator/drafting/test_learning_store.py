"""What a coordinator learned of its workers, kept for the next processes (SourceLearning's store,
coordinator/drafting/learning_store.py): read back by a new SourceLearning, the fading counted across processes,
merged where two share the file, forgotten after STORED_TTL_S, and a file per set of workers. The real pair through
`coordinator generate` in tests/test_real_ik.py."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from coordinator.drafting.learned import FORGET_AFTER_REQUESTS, OVERHEAD_S, STORED_TTL_S, STREAM, TTL_S, SourceLearning
from coordinator.drafting.learning_store import LEARNING_CACHE_VARIABLE, learning_store


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_new_learning_starts_from_what_the_last_one_kept_and_the_fading_counts_on(tmp_path):
    store = tmp_path / "learned.json"
    first = SourceLearning(store=store)
    first.record("model", 0.04, OVERHEAD_S)
    first.record("streamed", 0.8, STREAM)
    assert SourceLearning().start_generation() == {}, "no store: nothing carried"
    second = SourceLearning(store=store)
    assert second.start_generation() == {"model": pytest.approx(0.04), "streamed": pytest.approx(0.8)}
    third = SourceLearning(store=store)  # the generation of the second counted: half the excess is left (the
    assert third.start_generation() == {"model": pytest.approx(0.04), "streamed": pytest.approx(0.9)}  # overhead held)
    assert third.get("model").requests_since == 2


def test_a_measurement_made_by_another_process_replaces_an_older_one_here(tmp_path):
    clock = Clock()
    store = tmp_path / "learned.json"
    here, there = SourceLearning(clock, store), SourceLearning(clock, store)
    here.record("model", 0.04, OVERHEAD_S)
    clock.now += 5
    there.record("model", 0.01, OVERHEAD_S)
    assert here.start_generation() == {"model": pytest.approx(0.01)}
    clock.now += 5
    here.record("model", 0.03, OVERHEAD_S)  # newer again: kept, and the other one takes it at its next start
    assert there.start_generation() == {"model": pytest.approx(0.03)}


def test_stored_values_live_as_long_as_the_workers_cached_costs(tmp_path):
    clock = Clock()
    store = tmp_path / "learned.json"
    SourceLearning(clock, store).record("model", 0.04, OVERHEAD_S)
    clock.now += TTL_S + 1  # past a process's own TTL, within the stored one
    assert SourceLearning(clock, store).start_generation() == {"model": pytest.approx(0.04)}
    clock.now += STORED_TTL_S
    assert SourceLearning(clock, store).start_generation() == {}


def test_a_store_unchanged_since_its_last_read_or_write_here_is_not_read_again(tmp_path, monkeypatch):
    store = tmp_path / "learned.json"
    learning, other = SourceLearning(store=store), SourceLearning(store=store)
    learning.record("model", 0.04, OVERHEAD_S)
    reads = []
    real_read_text = type(store).read_text
    monkeypatch.setattr(type(store), "read_text", lambda path, *a, **kw: reads.append(path) or real_read_text(path))
    learning.start_generation()
    learning.start_generation()
    assert reads == [], "its own writes: nothing new to read"
    other.record("model", 0.01, OVERHEAD_S)  # another process's write: read at the next start
    assert learning.start_generation() == {"model": pytest.approx(0.01)}
    assert len(reads) == 1


def test_what_is_past_its_age_is_left_out_of_the_store_and_a_lapse_is_kept_for_the_next_process(tmp_path):
    clock = Clock()
    store = tmp_path / "learned.json"
    learning = SourceLearning(clock, store)
    learning.record("model", 0.04, OVERHEAD_S)
    for _ in range(FORGET_AFTER_REQUESTS + 1):
        learning.start_generation()
    kept = json.loads(store.read_text())["entries"]["model"]
    assert kept["requests_since"] == FORGET_AFTER_REQUESTS and kept["lapses"] == 0, "forgotten, not yet dropped"
    other = SourceLearning(clock, store)  # another process: its generation assumes nothing, tries the model again
    assert other.start_generation() == {}
    other.record("model", 0.03, OVERHEAD_S)
    assert json.loads(store.read_text())["entries"]["model"]["lapses"] == 1
    learning.record("streamed", 0.8, STREAM)
    clock.now += STORED_TTL_S - 1
    learning.record("model", 0.03, OVERHEAD_S)
    clock.now += 2  # "streamed" is past its age: left out when the store is next written
    learning.record("model", 0.02, OVERHEAD_S)
    assert set(json.loads(store.read_text())["entries"]) == {"model"}


@pytest.mark.parametrize("content", ["not json", '{"entries": {"model": {"value": 99, "measured_at": 1, '
                                                '"requests_since": 0, "measure": "overhead"}}}',
                                     '{"entries": {"model": {"value": 0.1, "measure": "no such measure"}}}'])
def test_an_unreadable_store_adds_nothing_and_is_written_anew(tmp_path, content):
    store = tmp_path / "learned.json"
    store.write_text(content)
    learning = SourceLearning(store=store)
    assert learning.start_generation() == {}
    learning.record("model", 0.02, OVERHEAD_S)
    assert json.loads(store.read_text())["entries"]["model"]["value"] == 0.02


def test_a_store_that_cannot_be_written_leaves_the_learning_to_its_process(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    learning = SourceLearning(store=blocker / "learned.json")  # its folder would be a file
    learning.record("model", 0.02, OVERHEAD_S)
    assert learning.start_generation() == {"model": pytest.approx(0.02)}


def info(role: str, build: str = "b1", model: str = "m") -> SimpleNamespace:
    return SimpleNamespace(role=role, model_name=model, engine="ik", engine_build=build, device="cpu")


def test_a_file_per_set_of_workers_and_none_where_the_cache_is_off(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMESH_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(LEARNING_CACHE_VARIABLE, "1")
    pair = learning_store(info("verifier"), info("drafter", model="d"), None)
    assert pair is not None and pair.parent == tmp_path / "learned"
    assert pair == learning_store(info("verifier"), info("drafter", model="d"), None)
    assert pair != learning_store(info("verifier", build="b2"), info("drafter", model="d"), None)
    assert pair != learning_store(info("verifier"), info("drafter", model="d"), info("drafter", model="m"))
    monkeypatch.setenv("SPECMESH_COST_CACHE", "0")
    assert learning_store(info("verifier")) is None
    monkeypatch.delenv("SPECMESH_COST_CACHE")
    monkeypatch.setenv(LEARNING_CACHE_VARIABLE, "0")
    assert learning_store(info("verifier")) is None


def test_another_process_reads_what_this_one_kept(tmp_path):
    store = tmp_path / "learned.json"
    SourceLearning(store=store).record("model", 0.05, OVERHEAD_S)
    code = ("import sys; from pathlib import Path; from coordinator.drafting.learned import SourceLearning; "
            "print(SourceLearning(store=Path(sys.argv[1])).start_generation()['model'])")
    run = subprocess.run([sys.executable, "-c", code, str(store)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert float(run.stdout) == pytest.approx(0.05)
    assert json.loads(store.read_text())["entries"]["model"]["requests_since"] == 1
