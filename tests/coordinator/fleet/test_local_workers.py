"""Spawned local workers: started together (generate) or one at a time (benchmarks: quiet cost probes)."""

from __future__ import annotations

import pytest

import coordinator.fleet.local_workers as local_workers_module
from coordinator.fleet.local_workers import LocalWorkerSpec, local_workers
from coordinator.fleet.worker_client import RemoteWorker, measures_costs_later

SPECS = [LocalWorkerSpec("verifier", "tiny-random-qwen2", "cpu", "float64", threads=1),
         LocalWorkerSpec("drafter", "tiny-random-qwen2", "cpu", "float64", threads=1)]


@pytest.fixture
def events(monkeypatch) -> list[tuple[str, str]]:
    """What happened to the workers, in order: ("start", role) when a process is spawned, ("serving", role) once
    the coordinator has seen it SERVING, ("costs", role) once it has seen its measured costs."""
    seen: list[tuple[str, str]] = []

    class Recorded(local_workers_module.LocalWorker):
        def __init__(self, spec, log_dir) -> None:
            seen.append(("start", spec.role))
            super().__init__(spec, log_dir)

        def wait_serving(self, *args, **kwargs) -> None:
            super().wait_serving(*args, **kwargs)
            seen.append(("serving", self.spec.role))

        def wait_costs(self, *args, **kwargs) -> None:
            super().wait_costs(*args, **kwargs)
            seen.append(("costs", self.spec.role))

    monkeypatch.setattr(local_workers_module, "LocalWorker", Recorded)
    return seen


def test_workers_start_together_by_default(events):
    with local_workers(SPECS, progress=False) as addresses:
        assert set(addresses) == {"verifier", "drafter"}
    assert events[:2] == [("start", "verifier"), ("start", "drafter")]


def test_one_at_a_time_starts_each_worker_once_the_previous_one_has_measured_its_costs(events):
    """A worker measures its costs after SERVING (none are cached for a tiny model): the next one starts only then,
    so that its loading does not disturb them, and every worker reports them once the workers are yielded."""
    with local_workers(SPECS, progress=False, one_at_a_time=True) as addresses:
        assert set(addresses) == {"verifier", "drafter"}
        for role, address in addresses.items():
            worker = RemoteWorker(address, role)
            try:
                assert not measures_costs_later(worker.info())
            finally:
                worker.close()
    assert events == [("start", "verifier"), ("serving", "verifier"), ("costs", "verifier"),
                      ("start", "drafter"), ("serving", "drafter"), ("costs", "drafter")]
