"""What the draft model's workers likely hold (coordinator/fleet/drafter_prefixes.py), and what opening a hybrid's
model session would prefill (LazyDraftSource.opening_tokens)."""

from __future__ import annotations

import pytest

from coordinator.fleet.drafter_prefixes import DrafterPrefixes
from coordinator.fleet.remote_sessions import LazyDraftSource
from coordinator.loop import Draft


class Opened:
    def __init__(self):
        self.histories, self.committed = [], []

    def __call__(self, history):
        self.histories.append(history)
        return self

    def propose(self, k, after=()):
        return Draft((9,) * k)

    def update(self, committed):
        self.committed.extend(committed)


def test_the_longest_prefix_a_remembered_session_holds_counts_and_sessions_grow_as_they_learn():
    prefixes = DrafterPrefixes(remembered=2)
    assert prefixes.cached([1, 2, 3]) == 0
    first = [1, 2, 3, 4]
    prefixes.opened(first)
    prefixes.opened([1, 2, 7])
    assert prefixes.cached([1, 2, 3, 4, 5]) == 4 and prefixes.cached([1, 2, 7, 8]) == 3 and prefixes.cached([2]) == 0
    first.append(5)  # the session learned a committed token: the worker holds it too
    assert prefixes.cached([1, 2, 3, 4, 5, 6]) == 5
    prefixes.opened([8])  # the oldest is forgotten, as the worker's least recently used context is
    assert prefixes.cached([1, 2, 3, 4]) == 2
    with pytest.raises(ValueError, match="remembered"):
        DrafterPrefixes(remembered=0)


def test_an_opening_prefills_what_the_last_turn_s_session_left_uncached_and_all_of_a_moved_window():
    prefixes = DrafterPrefixes()
    turn_1 = list(range(300))
    first = LazyDraftSource(turn_1, Opened(), window=256, prefixes=prefixes)
    assert first.opening_tokens() == 300, "nothing held: the whole window (its start at 0 for 300 tokens)"
    first.update([1000, 1001])
    first.propose(2)
    assert first.opening_tokens() == 0, "open: nothing more to prefill"
    first.update([1002, 1003])
    # The next turn: the last one's prompt and answer, then the new question: only the question is new.
    turn_2 = [*turn_1, 1000, 1001, 1002, 1003, 2000, 2001, 2002]
    second = LazyDraftSource(turn_2, Opened(), window=256, prefixes=prefixes)
    assert second.opening_tokens() == 3
    second.update([3000])
    assert second.opening_tokens() == 4, "what the generation adds before the model's first round counts too"
    # A conversation past 512 tokens: the window starts at 256, a start no session held: all of it is new.
    moved = LazyDraftSource([*turn_2, *range(5000, 5300)], Opened(), window=256, prefixes=prefixes)
    assert moved.opening_tokens() == len(turn_2) + 300 - 256
    assert LazyDraftSource(turn_1, Opened(), window=256).opening_tokens() == 300, "without prefixes: all of it"
