"""The warm-up cost probe both roles share."""

from __future__ import annotations

import pytest

from specmesh.worker import cost_probe
from specmesh.worker.cost_probe import PROBE_CONTEXT_LENGTH, fastest_runs, probe_context


def test_probe_context_is_fixed_and_within_the_vocabulary():
    assert probe_context(1000) == probe_context(1000)
    assert len(probe_context(1000)) == PROBE_CONTEXT_LENGTH
    assert all(0 <= t < 5 for t in probe_context(5)) and len(set(probe_context(5))) == 5
    assert probe_context(0) == [0] * PROBE_CONTEXT_LENGTH  # no vocabulary: still a valid list


def test_fastest_runs_takes_each_probes_fastest_run_and_interleaves_them(monkeypatch):
    order: list[str] = []
    durations = {"a": iter([5, 2, 9]), "b": iter([4, 7, 3])}  # each run's seconds, on a fake clock
    now = [0]

    def run(key: str):
        def go() -> None:
            order.append(key)
            now[0] += next(durations[key])
        return go

    monkeypatch.setattr(cost_probe.time, "perf_counter", lambda: now[0])
    assert fastest_runs({"a": run("a"), "b": run("b")}, repeats=3) == {"a": 2, "b": 3}
    assert order == ["a", "b"] * 3


def test_fastest_runs_propagates_a_failing_probe():
    def fail() -> None:
        raise RuntimeError("probe failed")

    with pytest.raises(RuntimeError, match="probe failed"):
        fastest_runs({"x": fail})
