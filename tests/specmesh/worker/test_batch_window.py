"""The batch window: how long a new batch waits for recently answered sessions, on a real Condition and threads."""

from __future__ import annotations

import threading
import time

import pytest

from specmesh.worker.batch_window import BatchTurns, wait_for_active_sessions


def window_with_late_caller(last_batch_s: float, max_batch_wait_s: float, late_by_s: float) -> tuple[float, bool]:
    """Session "a" is queued, "b" was answered just now and queues `late_by_s` later: (seconds waited, whether "b"
    was queued when the wait ended)."""
    arrived = threading.Condition()
    queued = ["a"]

    def queue_b() -> None:
        time.sleep(late_by_s)
        with arrived:
            queued.append("b")
            arrived.notify_all()

    caller = threading.Thread(target=queue_b)
    answered_at = {"a": time.monotonic(), "b": time.monotonic()}
    caller.start()
    try:
        with arrived:
            started = time.monotonic()
            wait_for_active_sessions(arrived, lambda: list(queued), answered_at, 8, max_batch_wait_s, last_batch_s)
            return time.monotonic() - started, "b" in queued
    finally:
        caller.join()


def test_a_caller_within_the_window_is_waited_for_and_no_longer():
    waited, joined = window_with_late_caller(last_batch_s=0.05, max_batch_wait_s=0.5, late_by_s=0.05)
    assert joined and waited < 0.4


def test_a_caller_later_than_the_window_is_not_waited_for():
    waited, joined = window_with_late_caller(last_batch_s=0.05, max_batch_wait_s=0.02, late_by_s=0.3)
    assert not joined and 0.015 < waited < 0.2


def test_a_zero_window_never_waits():
    waited, joined = window_with_late_caller(last_batch_s=5.0, max_batch_wait_s=0.0, late_by_s=0.05)
    assert not joined and waited < 0.04


def test_sessions_gone_quiet_are_not_waited_for():
    arrived, answered_at = threading.Condition(), {"a": time.monotonic(), "gone": time.monotonic() - 10}
    with arrived:
        started = time.monotonic()
        wait_for_active_sessions(arrived, lambda: ["a"], answered_at, 8, 1.0, 0.5)
    assert time.monotonic() - started < 0.1 and "gone" not in answered_at


def test_a_caller_answered_by_another_returns_while_that_one_runs_its_next_batch():
    """The caller that ran a batch takes the next turn at once (a Decode stream calls again) and waits in it for the
    callers it answered: they must return meanwhile, without a turn of their own."""
    turns = BatchTurns()
    first_answered, next_answered = threading.Event(), threading.Event()
    other_answered, other_returned = threading.Event(), threading.Event()

    def first_batch() -> None:
        time.sleep(0.2)  # the other caller queues meanwhile and waits
        first_answered.set()
        other_answered.set()

    def next_batch() -> None:
        other_returned.wait(2.0)  # as a batch window waits for the callers just answered
        next_answered.set()

    def stream() -> None:
        turns.run_until_answered(first_answered.is_set, first_batch)
        turns.run_until_answered(next_answered.is_set, next_batch)

    runner = threading.Thread(target=stream)
    runner.start()
    time.sleep(0.05)
    turns.run_until_answered(other_answered.is_set, lambda: pytest.fail("a turn for a request already answered"))
    returned_during_next_batch = not next_answered.is_set()
    other_returned.set()
    runner.join()
    assert returned_during_next_batch
