"""The next-token guess a verifier's streamed step checks in its spare row (verifier/engine.py, next_token_guess):
prompt lookup (specmesh/decoding/prompt_lookup.py) of one token, up to 4-token matches, no minimum."""

from __future__ import annotations

import random

from specmesh.wire.history import TokenHistory
from specmesh.worker.session_store import Session
from verifier.engine import GUESS_LOOKUP, next_token_guess


def slow_guess(history: list[int], excluded=()) -> list[int]:
    """The definition, spelled out: the longest suffix (up to 4 tokens) seen before, its latest occurrence."""
    for length in range(min(GUESS_LOOKUP.max_ngram, len(history) - 1), 0, -1):
        suffix = history[-length:]
        for end in range(len(history) - 2, length - 2, -1):
            if history[end - length + 1:end + 1] == suffix:
                guess = history[end + 1]
                return [] if guess in excluded else [guess]
    return []


def guess(history: list[int], excluded=frozenset()) -> list[int]:
    return next_token_guess(Session(TokenHistory(history), sequence=None), frozenset(excluded))


def test_the_longest_suffix_seen_before_picks_its_latest_continuation():
    # "1 2 3" was followed by 4, later "2 3" by 9: the longer match wins over the later, shorter one.
    assert guess([1, 2, 3, 4, 7, 2, 3, 9, 1, 2, 3]) == [4]
    # Two occurrences of the same longest suffix: the latest one's continuation.
    assert guess([5, 6, 1, 5, 6, 2, 5, 6]) == [2]
    # Only the last token was seen before.
    assert guess([8, 3, 9, 8]) == [3]
    # A run of one token guesses more of it.
    assert guess([4, 4, 4]) == [4]


def test_nothing_to_go_on_gives_no_guess_and_excluded_tokens_are_never_guessed():
    assert guess([]) == []
    assert guess([7]) == []
    assert guess([1, 2, 3]) == []
    assert guess([1, 2, 1], excluded={2}) == []
    assert guess([1, 2, 1], excluded={3}) == [2]


def test_it_matches_the_definition_on_random_histories_and_on_one_session_s_growing_and_cut_history():
    rng = random.Random(7)
    for _ in range(2000):
        history = [rng.randrange(rng.choice((2, 4, 16))) for _ in range(rng.randrange(0, 40))]
        excluded = {rng.randrange(4)} if rng.random() < 0.3 else set()
        assert guess(history, excluded) == slow_guess(history, excluded), history
    # One session, as a stream uses it: its index kept and brought up to date, and rebuilt after a cut (a resync).
    session = Session(TokenHistory(), sequence=None)
    for step in range(300):
        if step % 50 == 49:
            session.history.truncate(len(session.history) // 2)
        session.history.extend([rng.randrange(6)])
        assert next_token_guess(session, frozenset()) == slow_guess(session.history.tokens)
