"""IdleUpkeep: a task runs only while no request is queued or running, until it has nothing left to do, and again
after the next request; never on a timer, never beside a request; a task that raises is not tried again."""

from __future__ import annotations

import threading
import time

from specmesh.worker import idle_upkeep
from specmesh.worker.cost_probe import RequestActivity
from specmesh.worker.idle_upkeep import IdleUpkeep, spare_context_upkeep


def wait_until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


class Spares:
    """A task that makes `wanted` things, one a call, and notes whether a request was in flight at each call."""

    def __init__(self, activity: RequestActivity, wanted: int) -> None:
        self.activity, self.wanted, self.calls, self.beside_a_request = activity, wanted, 0, 0
        self.in_flight = 0

    def __call__(self) -> bool:
        self.calls += 1
        self.beside_a_request += self.in_flight > 0
        if self.wanted:
            self.wanted -= 1
            return True
        return False


def test_runs_while_quiet_until_done_then_again_only_after_a_request(monkeypatch):
    monkeypatch.setattr(idle_upkeep, "QUIET_BEFORE_UPKEEP_S", 0.02)
    activity = RequestActivity()
    task = Spares(activity, wanted=2)
    upkeep = IdleUpkeep("test", activity, task).start()
    try:
        wait_until(lambda: task.calls == 3)  # made 2, then had nothing to do
        time.sleep(0.2)
        assert task.calls == 3 and upkeep.runs == 2  # idle: not called again on a timer
        with activity.request():  # a request used up what was made
            task.in_flight += 1
            task.wanted = 1
            time.sleep(0.1)
            assert task.calls == 3  # never beside a request
            task.in_flight -= 1
        wait_until(lambda: task.calls == 5)
        time.sleep(0.1)
        assert task.calls == 5 and upkeep.runs == 3 and task.beside_a_request == 0
    finally:
        upkeep.stop()
    assert not upkeep.thread.is_alive()


def test_a_request_arriving_before_the_quiet_interval_defers_the_task(monkeypatch):
    monkeypatch.setattr(idle_upkeep, "QUIET_BEFORE_UPKEEP_S", 0.3)
    activity = RequestActivity()
    task = Spares(activity, wanted=1)
    release = threading.Event()

    def request() -> None:
        with activity.request():
            release.wait(5)
    caller = threading.Thread(target=request)
    caller.start()
    upkeep = IdleUpkeep("test", activity, task).start()
    try:
        time.sleep(0.5)
        assert task.calls == 0  # a request is running
        released_at = time.monotonic()
        release.set()
        caller.join()
        wait_until(lambda: task.calls >= 1)
        assert time.monotonic() - released_at >= 0.3  # and then only after the quiet interval
    finally:
        upkeep.stop()


def test_a_task_that_raises_is_not_tried_again(monkeypatch, caplog):
    monkeypatch.setattr(idle_upkeep, "QUIET_BEFORE_UPKEEP_S", 0.01)
    activity = RequestActivity()
    calls = []

    def broken() -> bool:
        calls.append(1)
        raise RuntimeError("no memory for a context")
    upkeep = IdleUpkeep("test", activity, broken).start()
    upkeep.thread.join(5)
    assert not upkeep.thread.is_alive() and calls == [1]
    assert "idle upkeep failed" in caplog.text and "no memory for a context" in caplog.text
    with activity.request():
        pass
    time.sleep(0.1)
    assert calls == [1]


def test_only_engines_with_spare_contexts_get_an_upkeep_which_makes_one_at_once_and_the_next_after_a_request():
    class NoContexts:
        def run_on_model_thread(self, fn, *args):
            return fn(*args)

    class WithContexts(NoContexts):
        made = 0

        def keep_spare_context(self) -> bool:
            self.made += 1
            return self.made < 3

    activity, lock = RequestActivity(), threading.Lock()
    assert spare_context_upkeep("verifier", NoContexts(), activity, lock) is None
    engine = WithContexts()
    upkeep = spare_context_upkeep("verifier", engine, activity, lock)
    try:
        assert engine.made == 1  # made before it returned: before the worker reports SERVING
        time.sleep(0.3)
        assert engine.made == 1 and upkeep.runs == 0  # nothing used it up: not tried again
        with activity.request():
            pass
        wait_until(lambda: engine.made == 3)
        assert upkeep.runs == 1
    finally:
        upkeep.stop()
