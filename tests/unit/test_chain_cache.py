"""Which cached context a chained Responses turn may take: the entry's count and version must be the ones its head's
row calls for now (store/response_heads.py cached_chain), so an entry written from a read older than a deletion on the
chain's conversation is never served."""

from __future__ import annotations

from statestore.store.cache_entry import CachedHistory
from statestore.store.response_heads import cached_chain
from statestore.store.response_records import ResponseRow


def row(depth: int, version: int | None) -> ResponseRow:
    return ResponseRow("resp_b", "resp_a", depth, 100, b"{}", version)


def test_a_chain_of_its_own_counts_segments_only() -> None:
    entry = CachedHistory(5, b"x")
    assert cached_chain(row(4, None), entry) is entry
    assert cached_chain(row(5, None), entry) is None  # an entry of another depth is not this head's context
    assert cached_chain(row(4, None), None) is None


def test_a_chain_begun_on_a_conversation_takes_only_an_entry_of_the_conversation_s_version() -> None:
    written_at_3 = CachedHistory(3, b"with the item", version=3)
    assert cached_chain(row(2, 3), written_at_3) is written_at_3
    assert cached_chain(row(2, 4), written_at_3) is None  # an item was deleted (or added) since it was written
    assert cached_chain(row(2, -1), written_at_3) is None  # the conversation is gone


def test_an_entry_of_a_chain_of_its_own_is_not_one_begun_on_a_conversation() -> None:
    unversioned = CachedHistory(3, b"x")
    assert cached_chain(row(2, 0), unversioned) is None
    assert cached_chain(row(2, None), CachedHistory(3, b"x", version=0)) is None
