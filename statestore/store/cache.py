"""The hot copy of each thread's history: its stored messages as one pre-joined byte string.

The database is the source of truth. A cache entry says how many messages it holds, and the caller
compares that with the thread's position in the database, so an entry that is missing, shorter or
longer is simply rebuilt from the database. That is why every fault here degrades to a miss: losing
the cache (or a write to it) costs a rebuild, never data. What an entry is (its key, its contents, the format of
its count) is store/cache_entry.py; this module says what a cache does (HistoryCache) and what a store of raw frames
does (FrameStore); store/redis_cache.py keeps entries in Redis, store/memory_cache.py in the process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from statestore.content_keys import ContentSealer
from statestore.store.cache_entry import CachedHistory, CacheKey
from statestore.store.thread_claims import Settle


class HistoryCache(Protocol):
    """Where a thread's pre-joined history is kept between turns; every method is fault-free for callers.

    Every write names the `sealer` of the entry's erasure scope (`await content.sealer(scope)`, CLEAR when encryption
    is off): with encryption on the cache is a SealedCache (store/sealed_cache.py) and seals what it writes with it;
    a clear cache ignores it."""

    @property
    def errors(self) -> int:
        """Faults swallowed so far (exported as a metric)."""
        ...

    async def get(self, key: CacheKey) -> CachedHistory | None: ...

    async def put(
        self, key: CacheKey, history: CachedHistory, ttl_ms: int, *, sealer: ContentSealer, then: Settle | None = None
    ) -> None:
        """Write the entry. `then`: a thread commit's row and claim (store/thread_claims.py), settled in the same
        step; only a cache that claims (a standalone Redis in clear) is given one."""
        ...

    async def append(
        self,
        key: CacheKey,
        expected_count: int,
        added: list[bytes],
        ttl_ms: int,
        *,
        sealer: ContentSealer,
        new_count: int | None = None,
        then: Settle | None = None,
    ) -> None:
        """Append `added` if the entry holds exactly `expected_count` messages and refresh its TTL;
        otherwise (missing or stale) drop the entry so the next read rebuilds it. Atomic. `new_count`: the count
        after, when the caller counts something else than joined messages (default `expected_count + len(added)`).
        `then`: as for `put`; the row is kept only beside the history it belongs to."""
        ...

    async def move(
        self,
        old: CacheKey,
        new: CacheKey,
        expected_count: int,
        added: list[bytes],
        ttl_ms: int,
        *,
        sealer: ContentSealer,
        then: Settle | None = None,
    ) -> bool:
        """The entry of `old`, if it holds `expected_count`, becomes `new`'s with `added` appended (a chain's
        head moving on: the bytes are not sent again). Atomic; the old entry is gone afterwards, its row with it.
        False when nothing moved (missing, stale, a fault, or a cache that cannot move between keys): the caller puts
        instead. `then`: the new head's row (store/response_heads.py), kept only beside the context it moved."""
        ...

    async def delete(self, key: CacheKey) -> bool:
        """Whether the entry is surely gone (False: the cache could not be reached)."""

    async def delete_many(self, keys: Sequence[CacheKey]) -> bool:
        """Whether every entry is surely gone."""

    async def ping(self) -> bool: ...

    async def aclose(self) -> None: ...

    @property
    def kind(self) -> str: ...


class FrameStore(Protocol):
    """What a SealedCache (store/sealed_cache.py) keeps its entries in: raw bytes and a count string, appended and
    moved by the same atomic steps as a clear entry, with no separator of its own (the frames carry theirs)."""

    async def get_raw(self, key: CacheKey) -> tuple[bytes, bytes] | None:
        """(count as stored, bytes), or None."""
        ...

    async def put_raw(self, key: CacheKey, count: bytes, data: bytes, ttl_ms: int) -> None: ...

    async def append_raw(self, key: CacheKey, expected: bytes, count: bytes, tail: bytes, ttl_ms: int) -> None: ...

    async def move_raw(
        self, old: CacheKey, new: CacheKey, *, expected: bytes, count: bytes, tail: bytes, ttl_ms: int
    ) -> bool: ...

    async def delete(self, key: CacheKey) -> bool: ...


def append_tail(expected_count: int, added: list[bytes]) -> bytes:
    """What an append adds to an entry of `expected_count` messages: an entry of none is b"" and takes no comma."""
    tail = b",".join(added)
    return b"," + tail if expected_count > 0 and added else tail
