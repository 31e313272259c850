"""The suffix trees of SuffixDecoding (drafter/suffix_tree.py): what they count, against a brute-force count of every
substring; how a session's tree follows a history that grows and is cut back; how the global tree evicts its oldest
sequences and ends up as a tree built afresh over the rest; and the drafts read from them."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drafter.suffix_tree import GlobalTree, SessionTree, SuffixTree, brute_force_counts


def session_tree(tokens, max_depth=8, **options) -> SessionTree:
    tree = SessionTree(max_depth, **options)
    tree.extend(tokens)
    return tree


def global_tree(sequences, max_depth=8, max_tokens=10**9, max_sequences=10**9) -> GlobalTree:
    tree = GlobalTree(max_depth, max_tokens, max_sequences)
    for seq in sequences:
        tree.add(seq)
    return tree


# ---- counts ----

def test_counts_every_substring_up_to_the_depth():
    tree = session_tree([1, 2, 1, 2, 3], max_depth=3)
    tree.check()
    assert tree.counts() == brute_force_counts([[1, 2, 1, 2, 3]], 3)
    counts = tree.counts()
    assert (counts[(1,)], counts[(1, 2)], counts[(2, 1)], counts[(1, 2, 3)]) == (2, 2, 1, 1)
    assert (1, 2, 1, 2) not in counts  # deeper than max_depth
    assert tree.num_nodes() <= 2 * len(tree) + 1  # compressed: not tokens x depth


def test_memory_grows_with_tokens_not_with_depth():
    rng = random.Random(0)
    block = [rng.randrange(1000) for _ in range(300)]
    history = block + block + block[:150] + [rng.randrange(1000) for _ in range(200)] + block
    tree = session_tree(history, max_depth=64)
    tree.check()
    assert tree.num_nodes() <= 2 * len(history)
    shared = global_tree([block, block, block[100:]], max_depth=64)
    assert shared.num_nodes() <= 2 * 300


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.one_of(st.lists(st.integers(0, 3), min_size=1, max_size=10),  # extend by these tokens
                              st.integers(0, 40)),  # cut back to this length
                    min_size=1, max_size=12),
       max_depth=st.sampled_from([2, 3, 5, 16]), undo_tokens=st.sampled_from([0, 3, 128]))
def test_session_tree_follows_a_history_that_grows_and_is_cut_back(ops, max_depth, undo_tokens):
    tree, history = SessionTree(max_depth, undo_tokens), []
    for op in ops:
        if isinstance(op, int):
            tree.truncate(op)
            del history[op:]
        else:
            tree.extend(op)
            history += op
        assert list(tree.tokens) == history
        tree.check()
        assert tree.counts() == brute_force_counts([history], max_depth)


def test_session_tree_undoes_recent_tokens_and_rebuilds_past_the_log():
    rng = random.Random(1)
    history = [rng.randrange(4) for _ in range(60)]
    tree = session_tree(history[:50], max_depth=6, undo_tokens=8)  # longer than the log: not logged
    for a, b in ((50, 54), (54, 58), (58, 60)):  # logged, the oldest dropped past 8 tokens: 54.. stays undoable
        tree.extend(history[a:b])
    root = tree.root
    tree.truncate(55)
    assert tree.root is root  # undone, not rebuilt
    fresh = session_tree(history[:55], max_depth=6)
    assert tree.counts() == fresh.counts() and tree.num_nodes() == fresh.num_nodes()
    tree.truncate(20)  # deeper than the log: rebuilt
    assert tree.root is not root
    assert tree.counts() == brute_force_counts([history[:20]], 6)
    tree.extend(history[20:])
    assert tree.counts() == brute_force_counts([history], 6)


# ---- the global tree: bounded, oldest first ----

@settings(max_examples=150, deadline=None)
@given(sequences=st.lists(st.lists(st.integers(0, 3), max_size=14), min_size=1, max_size=12),
       max_depth=st.sampled_from([2, 3, 6]), max_tokens=st.sampled_from([6, 25, 10**6]),
       max_sequences=st.sampled_from([1, 3, 100]))
def test_eviction_leaves_the_tree_of_the_remaining_sequences(sequences, max_depth, max_tokens, max_sequences):
    tree = GlobalTree(max_depth, max_tokens, max_sequences)
    kept: list[list[int]] = []
    for seq in sequences:
        tree.add(seq)
        if seq:
            kept.append(seq[-max_tokens:])  # one longer than the budget keeps its last tokens
        while sum(map(len, kept)) > max_tokens or len(kept) > max_sequences:
            kept.pop(0)
        assert [list(s) for s in tree.sequences] == kept
        assert tree.num_tokens == sum(map(len, kept)) <= max_tokens
        tree.check()
        fresh = global_tree(kept, max_depth)
        assert tree.counts() == fresh.counts() == brute_force_counts(kept, max_depth)
        assert tree.num_nodes() == fresh.num_nodes()  # pruned and re-compressed, not only decremented


def test_memory_stays_bounded_under_a_stream_of_requests():
    rng = random.Random(2)
    template = [rng.randrange(500) for _ in range(40)]
    tree = GlobalTree(32, max_tokens=3_000, max_sequences=10**6)
    for _ in range(300):
        tree.add([*template[:20], *[rng.randrange(500) for _ in range(5)], *template[20:], rng.randrange(500)])
        assert tree.num_tokens <= 3_000
        assert tree.num_nodes() <= 2 * tree.num_tokens + 1
    tree.check()
    assert tree.counts() == brute_force_counts(tree.sequences, 32)
    while tree.sequences:
        tree.remove_oldest()
    assert tree.num_nodes() == 1 and tree.root.count == 0 and not tree.root.kids  # nothing left behind


def test_bounds_are_checked():
    with pytest.raises(ValueError):
        SuffixTree(1)
    with pytest.raises(ValueError):
        GlobalTree(8, max_tokens=0)
    with pytest.raises(ValueError):
        GlobalTree(8, max_sequences=0)


# ---- drafts ----

def test_longest_match_with_a_continuation():
    tree = session_tree([5, 1, 2, 3, 9, 1, 2, 3], max_depth=8)
    # "1 2 3" occurred before, followed by 9; "9 1 2 3" only ends the history, followed by nothing
    length, _ = tree.longest_match(list(tree.tokens), 8)
    assert length == 3
    assert tree.speculate(list(tree.tokens), 4).tokens == (9, 1, 2)  # 3 tokens after a 3-token match
    assert session_tree([1, 2, 3]).speculate([1, 2, 3], 4).tokens == ()  # nothing repeats


def test_draft_length_scales_with_the_match_length():
    history = [7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 9, 7, 8]  # "7 8" occurs twice before: a 2-token match
    tree = session_tree(history, max_depth=32)
    candidate = tree.speculate(history, 8)
    assert candidate.match_length == 2 and candidate.tokens == (9, 7)  # at most 1 x 2 tokens (ties: the most recent)
    # Up to 3 x 2 tokens, but the continuation runs into the end of the history: a tree does not wrap around.
    assert tree.speculate(history, 8, spec_factor=3.0).tokens == (9, 7, 8)
    longer = history + [9]  # "7 8 9" matches 3 tokens
    tree.extend([9])
    assert tree.speculate(longer, 8).match_length == 3 and len(tree.speculate(longer, 8).tokens) == 3
    assert tree.speculate(longer, 1).tokens == (7,)  # never more than k


def test_match_leaves_room_for_k_tokens_under_the_depth_bound():
    block = list(range(10, 40))
    tree = global_tree([block], max_depth=16)
    context = block[:20]  # could match 15 tokens, but then no token would fit below it
    candidate = tree.speculate(context, 6)
    assert candidate.match_length == 10 and candidate.tokens == tuple(block[20:26])


def test_drafting_stops_when_the_estimated_probability_falls_below_the_threshold():
    history = [1, 2, 3, 4, 0, 1, 2, 3, 5, 0, 1, 2, 3, 6, 0, 1, 2]
    tree = session_tree(history, max_depth=16)
    # "0 1 2" was followed by 3 twice (p = 1), then "0 1 2 3" by 5 once and by 6 once (p = 1/2 each; the most recent)
    candidate = tree.speculate(history, 8, spec_factor=4.0)
    assert candidate.match_length == 3
    assert candidate.tokens[:2] == (3, 6) and candidate.probs[:2] == (1.0, 0.5)
    assert tree.speculate(history, 8, spec_factor=4.0, min_prob=0.6).tokens == (3,)  # 1/2 < 0.6: stop there
    spread = [x for i in range(2, 14) for x in (1, i)] + [1]  # "1" was followed by 12 different tokens
    assert session_tree(spread).speculate(spread, 4).tokens == ()  # p = 1/12 < 0.1 for each


def test_the_most_frequent_continuation_wins():
    sequences = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 9], [1, 2, 8]]
    tree = global_tree(sequences, max_depth=8)
    candidate = tree.speculate([5, 1, 2], 4, spec_factor=2.0)
    assert candidate.tokens == (3, 4) and candidate.probs == (0.75, 0.5)
