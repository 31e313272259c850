"""The cost probe both roles share: what it measures, and how it measures in the background (only while the engine
is idle, never timing a call a request arrived during, stopping promptly)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import pytest

from coordinator.fleet.polling import wait_until
from specmesh.worker import cost_probe
from specmesh.worker.cost_probe import (PROBE_CONTEXT_LENGTH, BackgroundCostProbe, RequestActivity,
                                        costs_now_or_in_background, fastest_runs, probe_context, read_cached_costs,
                                        write_cached_costs)


def test_probe_context_is_fixed_and_within_the_vocabulary():
    assert probe_context(1000) == probe_context(1000)
    assert len(probe_context(1000)) == PROBE_CONTEXT_LENGTH
    assert all(0 <= t < 5 for t in probe_context(5)) and len(set(probe_context(5))) == 5
    assert probe_context(0) == [0] * PROBE_CONTEXT_LENGTH  # no vocabulary: still a valid list


def test_fastest_runs_takes_each_probes_fastest_run_and_interleaves_them():
    order: list[str] = []
    durations = {"a": iter([5, 2, 9]), "b": iter([4, 7, 3])}  # the seconds each run reports

    def run(key: str):
        def go() -> float:
            order.append(key)
            return next(durations[key])
        return go

    assert fastest_runs({"a": run("a"), "b": run("b")}, repeats=3) == {"a": 2, "b": 3}
    assert order == ["a", "b"] * 3


def test_fastest_runs_propagates_a_failing_probe():
    def fail() -> float:
        raise RuntimeError("probe failed")

    with pytest.raises(RuntimeError, match="probe failed"):
        fastest_runs({"x": fail})


# ------------------------------------------------------------------------------------------------ in the background

@pytest.fixture(autouse=True)
def short_quiet(monkeypatch, tmp_path):
    monkeypatch.setattr(cost_probe, "QUIET_BEFORE_PROBE_S", 0.02)
    monkeypatch.setattr(cost_probe, "QUIET_BEFORE_REMEASURE_S", 0.02)
    monkeypatch.setenv("SPECMESH_CACHE_DIR", str(tmp_path))


class Probes:
    """Probe calls that report scripted seconds (None: "only prepared"), and what happened to them."""

    def __init__(self, seconds: dict[str, list[float | None]]) -> None:
        self.seconds = {key: iter(values) for key, values in seconds.items()}
        self.calls: list[str] = []
        self.published: list[object] = []
        self.finished = 0

    def call(self, key: str):
        def run() -> float | None:
            self.calls.append(key)
            return next(self.seconds[key])
        return run

    def background(self, activity: RequestActivity, keys, cache_key=None, **options) -> BackgroundCostProbe:
        return BackgroundCostProbe("test", activity, {key: self.call(key) for key in keys},
                                   to_costs=lambda seconds: sorted(seconds.items()), publish=self.published.append,
                                   cache_key=cache_key, finish=self.finish, **options)

    def finish(self) -> None:
        self.finished += 1


def test_measures_each_probe_its_fastest_of_three_then_publishes_and_caches():
    probes = Probes({"a": [None, 0.5, 0.2, 0.3], "b": [0.4, 0.1, 0.6]})  # a's first call only prepares
    key = {"role": "test"}
    probe = probes.background(RequestActivity(), ["a", "b"], key).start()
    probe.thread.join(5)
    assert not probe.thread.is_alive()
    assert probes.published == [[("a", 0.2), ("b", 0.1)]]
    assert read_cached_costs(key) == [["a", 0.2], ["b", 0.1]]  # as JSON: what a restart publishes at once
    assert probes.calls == ["a", "a", "b"] + ["a", "b"] * 2 and probes.finished == 1


def test_a_probe_call_waits_while_a_request_runs_and_one_a_request_arrived_during_is_made_again():
    activity = RequestActivity()
    arrive = []

    def probe() -> float:
        arrive.append(1)
        if len(arrive) == 1:  # a request arrives while the first call runs: it waited, the timing is disturbed
            with activity.request():
                pass
            return 0.001
        return 0.5

    published = []
    with activity.request():  # a request in flight: the probe waits
        background = BackgroundCostProbe("test", activity, {"a": probe}, to_costs=lambda s: s["a"],
                                         publish=published.append, cache_key=None).start()
        time.sleep(0.2)
        assert arrive == []
    background.thread.join(5)
    assert published == [0.5], "the disturbed call's 0.001 s was not kept"
    assert len(arrive) == 4  # three undisturbed calls, and the disturbed one again


class BusyFirst:
    """Stands in for machine_load.OthersCpu: the first `calls` probe calls ran while another process computed."""

    def __init__(self, calls: float) -> None:
        self.left = calls

    def __call__(self) -> "BusyFirst.Reading":
        self.left -= 1
        return BusyFirst.Reading(busy=self.left >= 0)

    @dataclass
    class Reading:
        busy: bool
        wall_s: float = 0.0
        others_s: float = 1.0

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            pass


def test_a_probe_call_made_while_another_process_computed_is_made_again(monkeypatch):
    monkeypatch.setattr(cost_probe, "BUSY_PAUSE_S", 0.01)
    probes = Probes({"a": [0.9, 0.8, 0.2, 0.3, 0.4]})  # the two calls beside another process read slow
    probe = probes.background(RequestActivity(), ["a"], others_cpu=BusyFirst(2)).start()
    probe.thread.join(5)
    assert probes.published == [[("a", 0.2)]] and len(probes.calls) == 5 and probe.busy_calls == 2


def test_a_machine_that_stays_busy_delays_the_costs_by_the_budget_only_and_says_so(monkeypatch, caplog):
    monkeypatch.setattr(cost_probe, "BUSY_PAUSE_S", 0.02)
    monkeypatch.setattr(cost_probe, "BUSY_RETRY_S", 0.05)  # two calls made again fit in it, not a third
    probes = Probes({"a": [0.9, 0.8, 0.7, 0.6, 0.5]})
    with caplog.at_level(logging.WARNING, logger=cost_probe.__name__):
        probe = probes.background(RequestActivity(), ["a"], others_cpu=BusyFirst(float("inf"))).start()
        probe.thread.join(5)
    assert probes.published == [[("a", 0.5)]] and len(probes.calls) == 5 and probe.busy_calls == 2
    assert [r.getMessage() for r in caplog.records].count(
        "test: other processes kept computing while its costs were measured (1.00 CPU s in a 0.00 s call): the "
        "costs may read high") == 1


def test_costs_measured_on_a_busy_machine_are_used_and_cached_as_disturbed(monkeypatch, caplog):
    monkeypatch.setattr(cost_probe, "BUSY_PAUSE_S", 0.02)
    monkeypatch.setattr(cost_probe, "BUSY_RETRY_S", 0.05)
    key = {"role": "test"}
    probes = Probes({"a": [0.9, 0.8, 0.7, 0.6, 0.5]})
    with caplog.at_level(logging.WARNING, logger=cost_probe.__name__):
        probe = probes.background(RequestActivity(), ["a"], key, others_cpu=BusyFirst(float("inf"))).start()
        probe.thread.join(5)
    assert probes.published == [[("a", 0.5)]] and probe.disturbed_calls == 3
    assert read_cached_costs(key) == [["a", 0.5]] and read_cached_costs(key, quiet=True) is None
    assert "used, and measured again at the next start" in caplog.text
    # The next start reports them at once, and measures again: on a quiet machine, cached as always.
    monkeypatch.setattr(cost_probe, "cost_cache_key", lambda role, loaded: key)
    quiet = Probes({"a": [0.3, 0.2, 0.4]})
    with caplog.at_level(logging.INFO, logger=cost_probe.__name__):
        background = costs_now_or_in_background("test", None, RequestActivity(), {"a": quiet.call("a")},
                                                to_costs=lambda s: s["a"], publish=quiet.published.append)
        assert background is not None and wait_until(lambda: not background.thread.is_alive(), 5)
    assert quiet.published == [[["a", 0.5]], 0.2] and read_cached_costs(key, quiet=True) == 0.2
    assert "reporting costs measured on a busy machine while it measures them again" in caplog.text


def test_costs_published_already_are_measured_again_on_an_idle_machine_only(monkeypatch, caplog):
    """Costs past their age are reported at once and measured again, but nothing waits for that measurement: its
    calls wait for QUIET_BEFORE_REMEASURE_S without a request (a generation's rounds leave a worker idle for
    less) and for a machine where no other process computes, for as long as that takes (no BUSY_RETRY_S budget:
    nothing is measured beside other processes' work, so nothing disturbed replaces what was published)."""
    monkeypatch.setenv("SPECMESH_PROBE_QUIET_SAMPLE_S", "0.01")
    monkeypatch.setattr(cost_probe, "BUSY_PAUSE_S", 0.01)
    monkeypatch.setattr(cost_probe, "BUSY_RETRY_S", 0.03)  # a first measurement would stop waiting after 2 samples
    monkeypatch.setattr(cost_probe, "QUIET_BEFORE_REMEASURE_S", 0.3)
    key = {"role": "test"}
    monkeypatch.setattr(cost_probe, "cost_cache_key", lambda role, loaded: key)
    write_cached_costs(key, 0.25)
    monkeypatch.setattr(cost_probe, "COST_CACHE_TTL_S", 0.0)  # past its age: published, and measured again
    monkeypatch.setattr(cost_probe, "OthersCpu", BusyFirst(12))  # 12 busy samples, then a quiet machine
    activity, calls_at = RequestActivity(), []
    probes = Probes({"a": [0.3, 0.2, 0.4]})

    def call() -> float:
        calls_at.append(time.monotonic())
        return probes.call("a")()
    with activity.request():
        pass
    request_ended = time.monotonic()
    with caplog.at_level(logging.INFO, logger=cost_probe.__name__):
        background = costs_now_or_in_background("test", None, activity, {"a": call}, to_costs=lambda s: s["a"],
                                                publish=probes.published.append)
        assert probes.published == [0.25]  # at once, before any probe call
        assert background is not None and wait_until(lambda: not background.thread.is_alive(), 10)
    assert probes.published == [0.25, 0.2] and background.disturbed_calls == 0 and background.waited_calls >= 12
    assert calls_at[0] - request_ended >= 0.3, "a call came sooner after a request than a re-measure waits"
    assert read_cached_costs(key, float("inf"), quiet=True) == 0.2
    assert "while it measures them again (on an idle machine" in caplog.text
    assert "waits for them (for as long as they do: its costs are reported already)" in caplog.text


def test_the_probes_of_one_machine_take_turns(monkeypatch):
    """Two workers' probes (here two in one process, as in tests and embeddings): never two calls at once."""
    running, overlaps = [], []

    def call() -> float:
        running.append(1)
        overlaps.append(len(running) > 1)
        time.sleep(0.02)
        running.pop()
        return 0.1

    first, second = (BackgroundCostProbe(name, RequestActivity(), {"a": call, "b": call}, to_costs=dict,
                                         publish=lambda costs: None, cache_key=None, others_cpu=BusyFirst(0))
                     for name in ("one", "two"))
    first.start(), second.start()
    first.thread.join(5), second.thread.join(5)
    assert len(overlaps) == 12 and not any(overlaps)


def test_stop_while_waiting_for_quiet_ends_at_once_and_publishes_nothing():
    activity, probes = RequestActivity(), Probes({"a": [0.1] * 3})
    with activity.request():
        probe = probes.background(activity, ["a"]).start()
        time.sleep(0.05)
        started = time.monotonic()
        probe.stop()
        assert time.monotonic() - started < 1.0
    assert not probe.thread.is_alive()
    assert probes.calls == [] and probes.published == [] and probes.finished == 1


def test_stop_during_a_probe_call_waits_for_that_call_only():
    activity, in_call, release = RequestActivity(), threading.Event(), threading.Event()
    calls, published = [], []

    def probe() -> float:
        calls.append(1)
        in_call.set()
        release.wait(5)
        return 0.1

    background = BackgroundCostProbe("test", activity, {"a": probe}, to_costs=lambda s: s["a"],
                                     publish=published.append, cache_key=None).start()
    assert in_call.wait(5)
    threading.Timer(0.2, release.set).start()
    started = time.monotonic()
    background.stop()
    assert 0.1 < time.monotonic() - started < 3.0
    assert not background.thread.is_alive() and calls == [1] and published == []


def test_a_failing_probe_publishes_nothing_and_says_why(caplog):
    def fail() -> float:
        raise RuntimeError("no model")

    published, finished = [], []
    with caplog.at_level(logging.WARNING, logger=cost_probe.__name__):
        probe = BackgroundCostProbe("test", RequestActivity(), {"a": fail}, to_costs=lambda s: s, cache_key=None,
                                    publish=published.append, finish=lambda: finished.append(1)).start()
        probe.thread.join(5)
    assert published == [] and finished == [1]
    assert "measuring the costs failed" in caplog.text and "no model" in caplog.text


def test_cached_costs_are_published_at_once_without_a_thread(monkeypatch):
    key = {"role": "test"}
    monkeypatch.setattr(cost_probe, "cost_cache_key", lambda role, loaded: key)
    write_cached_costs(key, 0.25)
    probes = Probes({"a": []})
    assert costs_now_or_in_background("test", None, RequestActivity(), {"a": probes.call("a")}, to_costs=float,
                                      publish=probes.published.append) is None
    assert probes.published == [0.25] and probes.calls == []
    # Not cached: a thread measures, and its result is cached for the next start.
    monkeypatch.setattr(cost_probe, "cost_cache_key", lambda role, loaded: {"role": "other"})
    probes = Probes({"a": [0.3, 0.2, 0.4]})
    background = costs_now_or_in_background("test", None, RequestActivity(), {"a": probes.call("a")},
                                            to_costs=lambda s: s["a"], publish=probes.published.append)
    assert background is not None and wait_until(lambda: not background.thread.is_alive(), 5)
    assert probes.published == [0.2] and read_cached_costs({"role": "other"}) == 0.2


def test_costs_past_their_age_are_reported_at_once_and_measured_again(monkeypatch, caplog):
    key = {"role": "test"}
    monkeypatch.setattr(cost_probe, "cost_cache_key", lambda role, loaded: key)
    write_cached_costs(key, 0.25)
    monkeypatch.setattr(cost_probe, "COST_CACHE_TTL_S", 0.0)  # too old to skip measuring, not too old to start from
    probes = Probes({"a": [0.3, 0.2, 0.4]})
    with caplog.at_level(logging.INFO, logger=cost_probe.__name__):
        background = costs_now_or_in_background("test", None, RequestActivity(), {"a": probes.call("a")},
                                                to_costs=lambda s: s["a"], publish=probes.published.append)
    assert probes.published[:1] == [0.25]  # before any probe call
    assert background is not None and wait_until(lambda: not background.thread.is_alive(), 5)
    assert probes.published == [0.25, 0.2] and read_cached_costs(key, float("inf")) == 0.2
    assert "reporting costs measured over 0 h ago while it measures them again" in caplog.text


def test_cached_costs_this_version_cannot_read_are_measured_again(monkeypatch, caplog):
    key = {"role": "test"}
    monkeypatch.setattr(cost_probe, "cost_cache_key", lambda role, loaded: key)
    write_cached_costs(key, "not a number")
    probes = Probes({"a": [0.3, 0.2, 0.4]})
    def publish(costs) -> None:
        probes.published.append(float(costs))  # ValueError for what is cached here

    background = costs_now_or_in_background("test", None, RequestActivity(), {"a": probes.call("a")},
                                            to_costs=lambda s: s["a"], publish=publish)
    assert background is not None and wait_until(lambda: not background.thread.is_alive(), 5)
    assert probes.published == [0.2] and read_cached_costs(key) == 0.2
    assert "ignoring cached costs 'not a number'" in caplog.text


def test_a_probe_call_waits_while_other_processes_compute_and_not_past_the_budget(monkeypatch):
    """Before each call other processes' CPU is sampled: while they compute (the other worker of the pair serving a
    request), no call is made; the waiting shares BUSY_RETRY_S with the calls made again, and past it the probe
    measures on the busy machine as before."""
    monkeypatch.setenv("SPECMESH_PROBE_QUIET_SAMPLE_S", "0.01")
    monkeypatch.setattr(cost_probe, "BUSY_PAUSE_S", 0.01)
    readings = BusyFirst(3)  # three busy samples before the first call, then quiet
    probes = Probes({"a": [0.3, 0.2, 0.4]})
    calls_when = []
    original = probes.call

    def call(key):
        inner = original(key)

        def timed_call():
            calls_when.append(readings.left)
            return inner()
        return timed_call
    probes.call = call
    probe = probes.background(RequestActivity(), ["a"], others_cpu=readings).start()
    probe.thread.join(5)
    assert probes.published == [[("a", 0.2)]] and probe.waited_calls == 3 and probe.busy_calls == 0
    assert all(left < 0 for left in calls_when)  # every call came after the busy samples

    monkeypatch.setattr(cost_probe, "BUSY_RETRY_S", 0.05)
    always = BusyFirst(float("inf"))
    probes = Probes({"a": [0.3, 0.2, 0.4]})
    probe = probes.background(RequestActivity(), ["a"], others_cpu=always).start()
    probe.thread.join(5)
    assert probes.published == [[("a", 0.2)]] and 1 <= probe.waited_calls <= 6  # waited, then measured anyway


def test_without_sampling_no_call_waits(monkeypatch):
    monkeypatch.setenv("SPECMESH_PROBE_QUIET_SAMPLE_S", "0")
    probes = Probes({"a": [0.3, 0.2, 0.4]})
    probe = probes.background(RequestActivity(), ["a"], others_cpu=BusyFirst(0)).start()
    probe.thread.join(5)
    assert probes.published == [[("a", 0.2)]] and probe.waited_calls == 0


def test_a_re_measure_without_sampling_keeps_the_budget_rather_than_call_again_forever(monkeypatch):
    """With sampling off (SPECMESH_PROBE_QUIET_SAMPLE_S=0, as the test suite runs) a re-measure cannot see other work
    coming, only a call it shared: it makes such calls again within BUSY_RETRY_S, then keeps them, as a first
    measurement does, instead of repeating a probe call beside the other work for as long as the worker lives."""
    monkeypatch.setattr(cost_probe, "BUSY_PAUSE_S", 0.01)
    monkeypatch.setattr(cost_probe, "BUSY_RETRY_S", 0.03)
    probes = Probes({"a": [0.9, 0.8, 0.7, 0.6, 0.5, 0.4]})
    probe = probes.background(RequestActivity(), ["a"], others_cpu=BusyFirst(float("inf")), remeasure=True).start()
    probe.thread.join(5)
    assert not probe.thread.is_alive() and probes.published and probe.disturbed_calls >= 1
