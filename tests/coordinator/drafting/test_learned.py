"""What a coordinator learns across generations, per draft source (coordinator/drafting/learned.py): kept per source,
fading with every generation that does not measure it again, forgotten after a few of them or after its TTL."""

from __future__ import annotations

import threading

import pytest

from coordinator.drafting.learned import (FORGET_AFTER_REQUESTS, MAX_OVERHEAD_S, MAX_SLOWDOWN, OVERHEAD_S, TTL_S, Learned,
                                         SourceLearning)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_each_source_keeps_its_own_slowdown():
    learning = SourceLearning()
    learning.record("model", 3.0)
    learning.record("suffix", 1.1)
    assert learning.start_generation() == {"model": 3.0, "suffix": pytest.approx(1.1)}


def test_a_slowdown_fades_with_each_generation_that_does_not_measure_it_and_is_then_forgotten():
    learning = SourceLearning()
    learning.record("model", 3.0)
    seen = [learning.start_generation().get("model") for _ in range(FORGET_AFTER_REQUESTS + 1)]
    assert seen[:4] == [3.0, 2.0, 1.5, 1.25], "the excess over 1 halves with each generation"
    assert seen[-1] is None, "forgotten after FORGET_AFTER_REQUESTS generations"
    learning.record("model", 0.5)  # faster than the costs: fades up towards 1 the same way
    assert [learning.start_generation()["model"] for _ in range(2)] == [0.5, 0.75]


def test_an_overhead_is_held_as_measured_until_forgotten_and_is_clamped_to_its_own_bounds():
    learning = SourceLearning()
    learning.record("model", 0.012, OVERHEAD_S)
    seen = [learning.start_generation().get("model") for _ in range(FORGET_AFTER_REQUESTS + 1)]
    assert seen == [0.012] * FORGET_AFTER_REQUESTS + [None]
    learning.record("model", -1.0, OVERHEAD_S)
    assert learning.get("model").value == 0.0
    learning.record("model", 1e6, OVERHEAD_S)
    assert learning.get("model").value == MAX_OVERHEAD_S
    with pytest.raises(ValueError, match="overhead"):
        Learned(-0.1, 0.0, measure=OVERHEAD_S)


def test_a_new_measurement_replaces_the_faded_one():
    learning = SourceLearning()
    learning.record("model", 4.0)
    learning.start_generation(), learning.start_generation()
    learning.record("model", 2.0)
    assert learning.start_generation() == {"model": 2.0}


def test_a_slowdown_is_forgotten_after_its_ttl():
    clock = Clock()
    learning = SourceLearning(clock)
    learning.record("model", 3.0)
    clock.now += TTL_S - 1
    assert learning.start_generation() == {"model": 3.0}
    clock.now += 1
    assert learning.start_generation() == {}


def test_measurements_are_clamped_and_entries_validated():
    learning = SourceLearning()
    learning.record("model", 40.0)
    assert learning.get("model").value == MAX_SLOWDOWN
    with pytest.raises(ValueError, match="slowdown"):
        Learned(9.0, 0.0)
    with pytest.raises(ValueError, match="requests_since"):
        Learned(1.0, 0.0, -1)


def test_concurrent_generations_count_each_start_once():
    learning = SourceLearning()
    learning.record("model", 3.0)
    threads = [threading.Thread(target=learning.start_generation) for _ in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert learning.get("model").requests_since == 4
