"""The history cache with encryption on: every entry sealed, in Redis and in process (Redis is often the least
protected part of a deployment).

An entry is a sequence of frames, each a 4-byte big-endian length and a sealed value whose plaintext is exactly the
bytes the clear entry would have had appended (its separator included). So a put writes one frame, an append or a
move appends one frame with the same atomic scripts as a clear entry (no separator of their own: the frame carries
it), and a read opens every frame with one `open_many` (one key lookup, then each frame decrypted from a view of
the entry: a long entry's bytes are not copied on the way, since each large allocation costs the first touch of its
pages) and joins them. Readers that meet many frames write the entry back as one (threads/context_cache.py), so a
long thread's hot read opens few values.

The associated data of a frame cannot name its key (a move renames it), so it is fixed: a frame is bound to its
scope by the scope's data key, not to its entry. Counts are written in format 3 (store/cache_entry.py), which a clear
cache never reads, and a sealed cache reads nothing else.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence

from statestore.content_keys import ContentKeys, ContentSealer, row_data
from statestore.store.cache import append_tail
from statestore.store.cache_entry import CachedHistory, CacheKey, decode_sealed_count, encode_sealed_count
from statestore.store.memory_cache import MemoryHistoryCache
from statestore.store.redis_cache import RedisHistoryCache
from statestore.store.thread_claims import Settle

log = logging.getLogger(__name__)

CACHE_DATA = row_data("cache")
_LENGTH = struct.Struct(">I")

# Past this many frames a turn puts its entry back whole, as one frame (both doors' cache writes): a read opens few
# large values, not one a turn.
CONSOLIDATE_FRAMES = 16


def sealed_frame(sealer: ContentSealer, plaintext: bytes) -> bytes:
    """One frame: the sealed value's length, then the value."""
    sealed = sealer.seal(plaintext, CACHE_DATA)
    return _LENGTH.pack(len(sealed)) + sealed


def split_frames(data: bytes) -> list[memoryview] | None:
    """The sealed values of an entry's bytes, in order, as views of them (nothing copied); None when the bytes are
    not a whole number of frames."""
    values: list[memoryview] = []
    at = 0
    end = len(data)
    view = memoryview(data)
    while at < end:
        if at + 4 > end:
            return None
        (length,) = _LENGTH.unpack_from(view, at)
        at += 4
        if at + length > end:
            return None
        values.append(view[at : at + length])
        at += length
    return values


class SealedCache:
    """A HistoryCache over Redis or the in-process cache that seals what it writes and opens what it reads."""

    __slots__ = ("_content", "_store")

    def __init__(self, store: RedisHistoryCache | MemoryHistoryCache, content: ContentKeys) -> None:
        self._store = store
        self._content = content

    @property
    def errors(self) -> int:
        return self._store.errors

    @property
    def kind(self) -> str:
        return self._store.kind

    @property
    def backend(self) -> RedisHistoryCache | MemoryHistoryCache:
        return self._store

    async def get(self, key: CacheKey) -> CachedHistory | None:
        found = await self._store.get_raw(key)
        if found is None:
            return None
        raw_count, data = found
        decoded = decode_sealed_count(raw_count)
        if decoded is None:
            return None  # a clear entry (or one of a format this code does not know): a miss
        count, version = decoded
        values = split_frames(data)
        if values is None or count < 0 or (count == 0) != (not values):
            log.warning("a sealed cache entry is malformed, served as a miss", extra={"cache_key": key.name})
            await self._store.delete(key)
            return None
        if not values:
            return CachedHistory(0, b"", version, frames=0)
        try:
            opened = await self._content.open_many(values, [CACHE_DATA] * len(values), row=f"cache {key.name}")
        except Exception as exc:
            # Every fault of the hot copy is a miss; the database is the truth. An erased scope's entry, one that
            # does not open, or the key store away: rebuilt from the database, which tells an erased thread (404) or an
            # unreadable row (500) apart.
            log.warning(
                "a sealed cache entry was not opened, served as a miss",
                extra={"cache_key": key.name, "error": type(exc).__name__},
            )
            await self._store.delete(key)
            return None
        joined = opened[0] if len(opened) == 1 else b"".join(opened)
        return CachedHistory(count, joined, version, frames=len(values))

    async def put(
        self, key: CacheKey, history: CachedHistory, ttl_ms: int, *, sealer: ContentSealer, then: Settle | None = None
    ) -> None:
        # `then` (a commit's row and claim) is a clear Redis's: claims are off with encryption, so never given here.
        data = sealed_frame(sealer, history.joined) if history.joined else b""
        await self._store.put_raw(key, encode_sealed_count(history.count, history.version), data, ttl_ms)

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
        count = expected_count + len(added) if new_count is None else new_count
        await self._store.append_raw(
            key,
            encode_sealed_count(expected_count),
            encode_sealed_count(count),
            _framed_tail(sealer, expected_count, added),
            ttl_ms,
        )

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
        return await self._store.move_raw(
            old,
            new,
            expected=encode_sealed_count(expected_count),
            count=encode_sealed_count(expected_count + len(added)),
            tail=_framed_tail(sealer, expected_count, added),
            ttl_ms=ttl_ms,
        )

    async def delete(self, key: CacheKey) -> bool:
        return await self._store.delete(key)

    async def delete_many(self, keys: Sequence[CacheKey]) -> bool:
        return await self._store.delete_many(keys)

    async def ping(self) -> bool:
        return await self._store.ping()

    async def aclose(self) -> None:
        await self._store.aclose()


def _framed_tail(sealer: ContentSealer, expected_count: int, added: list[bytes]) -> bytes:
    """The frame an append adds: the clear entry's tail (its separator included), sealed; nothing for nothing."""
    tail = append_tail(expected_count, added)
    return sealed_frame(sealer, tail) if tail else b""
