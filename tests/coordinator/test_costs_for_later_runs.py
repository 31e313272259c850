"""`coordinator generate` on local workers waits, after its answer, for workers that have not measured their costs
(coordinator/cli.py, measure_costs_for_later_runs): GGUF workers cache them, and the next run's cost policy starts
from them. Decisions on stand-ins here; the real default pair in tests/test_real_ik.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from coordinator import api, cli


def coordinator_over(answers: list) -> tuple[api.Coordinator, list]:
    """A Coordinator with the costs part only: its verifier's Info answers `answers` in turn (the last one again)."""
    reads = []

    def info(timeout_s):
        reads.append(time.monotonic())
        return answers[min(len(reads), len(answers)) - 1]

    pool = SimpleNamespace(first_serving=lambda: SimpleNamespace(address="v:1", info=info))
    coordinator = api.Coordinator.__new__(api.Coordinator)
    vars(coordinator).update(
        verifier_info=answers[0], drafter_info=SimpleNamespace(role="drafter", engine="", draft_per_token_s=0.0),
        suffix_drafter_info=None, verifiers=pool, drafters=None,
        suffix_drafters=None, round_trip_s={}, _model_round_trip_s={}, _costs_read_at=time.monotonic(),
        _costs_lock=api.threading.Lock())
    coordinator._set_cost_priors()
    return coordinator, reads


PENDING = SimpleNamespace(role="verifier", engine="ik", verify_base_s=0.0, verify_per_draft_s=0.0)
MEASURED = SimpleNamespace(role="verifier", engine="ik", verify_base_s=0.4, verify_per_draft_s=0.05)


def test_waiting_reads_the_costs_until_they_are_reported(monkeypatch):
    monkeypatch.setattr(api, "COST_WAIT_POLL_S", 0.01)
    coordinator, reads = coordinator_over([PENDING, PENDING, MEASURED])
    assert coordinator.costs_pending()
    assert coordinator.wait_for_costs(5.0)  # within COST_REFRESH_S of the last read: waiting reads anyway
    assert len(reads) == 3 and not coordinator.costs_pending() and coordinator.cost_prior.verify_s_base == 0.4


def test_waiting_gives_up_after_its_limit(monkeypatch):
    monkeypatch.setattr(api, "COST_WAIT_POLL_S", 0.01)
    coordinator, reads = coordinator_over([PENDING])
    started = time.monotonic()
    assert not coordinator.wait_for_costs(0.1)
    assert 0.1 <= time.monotonic() - started < 2.0 and len(reads) >= 3 and coordinator.costs_pending()


class StandIn:
    """What measure_costs_for_later_runs uses of a Coordinator."""

    def __init__(self, engine: str, pending: bool = True, measured: bool = True, interrupt: bool = False) -> None:
        self.verifier_info = SimpleNamespace(engine=engine)
        self.drafter_info = SimpleNamespace(engine=engine)
        self.pending, self.measured, self.interrupt, self.waited = pending, measured, interrupt, []

    def costs_pending(self) -> bool:
        return self.pending

    def wait_for_costs(self, timeout_s: float) -> bool:
        self.waited.append(timeout_s)
        if self.interrupt:
            raise KeyboardInterrupt
        return self.measured


@pytest.mark.parametrize("stand_in, environment", [
    (StandIn("ik", pending=False), {}),  # cached, or measured during the run
    (StandIn("transformers"), {}),  # no cost cache: the next start measures again anyway
    (StandIn("ik"), {"SPECMESH_COST_CACHE": "0"}),
])
def test_no_wait_where_it_would_not_help(stand_in, environment, monkeypatch, capsys):
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    cli.measure_costs_for_later_runs(stand_in)
    assert stand_in.waited == [] and capsys.readouterr().err == ""


@pytest.mark.parametrize("engine", ["ik", "llamacpp"])
def test_gguf_workers_get_time_to_measure_and_the_user_is_told(engine, monkeypatch, capsys):
    monkeypatch.delenv("SPECMESH_COST_CACHE", raising=False)
    stand_in = StandIn(engine)
    cli.measure_costs_for_later_runs(stand_in)
    err = capsys.readouterr().err
    assert stand_in.waited == [cli.COSTS_FOR_LATER_RUNS_S]
    assert "measure their costs for later runs" in err and "Ctrl-C skips it" in err
    assert "costs measured in" in err and "later runs start from them" in err


def test_a_wait_that_runs_out_or_is_interrupted_says_the_next_run_measures_again(monkeypatch, capsys):
    monkeypatch.delenv("SPECMESH_COST_CACHE", raising=False)
    cli.measure_costs_for_later_runs(StandIn("ik", measured=False))
    assert "the next run measures them again" in capsys.readouterr().err
    cli.measure_costs_for_later_runs(StandIn("ik", interrupt=True))  # Ctrl-C: no traceback, the run still succeeds
    assert "skipped: the next run measures them again" in capsys.readouterr().err
