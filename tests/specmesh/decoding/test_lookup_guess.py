"""The next-token guess a verifier's streamed step checks in its spare row (specmesh/decoding/lookup_guess.py)."""

from __future__ import annotations

import random

from specmesh.decoding.lookup_guess import LONGEST_MATCH, guess_next_token


def slow_guess(history: list[int], excluded=()) -> int | None:
    """The definition, spelled out: the longest suffix (up to LONGEST_MATCH) seen before, its latest occurrence."""
    for length in range(min(LONGEST_MATCH, len(history) - 1), 0, -1):
        suffix = history[-length:]
        for end in range(len(history) - 2, length - 2, -1):
            if history[end - length + 1:end + 1] == suffix:
                guess = history[end + 1]
                return None if guess in excluded else guess
    return None


def test_the_longest_suffix_seen_before_picks_its_latest_continuation():
    # "1 2 3" was followed by 4, later "2 3" by 9: the longer match wins over the later, shorter one.
    assert guess_next_token([1, 2, 3, 4, 7, 2, 3, 9, 1, 2, 3]) == 4
    # Two occurrences of the same longest suffix: the latest one's continuation.
    assert guess_next_token([5, 6, 1, 5, 6, 2, 5, 6]) == 2
    # Only the last token was seen before.
    assert guess_next_token([8, 3, 9, 8]) == 3
    # A run of one token guesses more of it.
    assert guess_next_token([4, 4, 4]) == 4


def test_nothing_to_go_on_gives_no_guess_and_excluded_tokens_are_never_guessed():
    assert guess_next_token([]) is None
    assert guess_next_token([7]) is None
    assert guess_next_token([1, 2, 3]) is None
    assert guess_next_token([1, 2, 1], excluded={2}) is None
    assert guess_next_token([1, 2, 1], excluded={3}) == 2


def test_it_matches_the_definition_on_random_histories():
    rng = random.Random(7)
    for _ in range(2000):
        history = [rng.randrange(rng.choice((2, 4, 16))) for _ in range(rng.randrange(0, 40))]
        excluded = {rng.randrange(4)} if rng.random() < 0.3 else set()
        assert guess_next_token(history, excluded) == slow_guess(history, excluded), history
