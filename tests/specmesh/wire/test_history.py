import pytest

from specmesh.wire.history import EMPTY_HASH, ResyncRequired, TokenHistory, history_hash


def test_prefix_hashes_match_direct_hash():
    h = TokenHistory([5, 0, 7, 9])
    for n in range(5):
        assert h.hash_at(n) == history_hash([5, 0, 7, 9][:n])
    assert h.hash_at(0) == EMPTY_HASH


def test_hash_depends_on_order_and_zero_tokens():
    assert history_hash([1, 2]) != history_hash([2, 1])
    assert history_hash([0]) != history_hash([])
    assert history_hash([0, 0]) != history_hash([0])


def test_apply_sync_appends_and_truncates_after_a_lost_reply():
    h = TokenHistory([1, 2, 3])
    h.apply_sync(3, history_hash([1, 2, 3]), [4, 5])
    assert h.tokens == [1, 2, 3, 4, 5]
    # A retried call that builds on an earlier prefix (its first attempt's reply was lost) is accepted.
    h.apply_sync(2, history_hash([1, 2]), [9])
    assert h.tokens == [1, 2, 9]


@pytest.mark.parametrize("base_length, base_tokens", [(4, [1, 2, 3, 4]), (2, [1, 7])])
def test_apply_sync_rejects_unknown_prefix(base_length, base_tokens):
    h = TokenHistory([1, 2, 3])
    with pytest.raises(ResyncRequired):
        h.apply_sync(base_length, history_hash(base_tokens), [])
    assert h.tokens == [1, 2, 3]
