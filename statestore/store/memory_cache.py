"""The in-process history cache of the embedded default (no Redis): the same contract as the Redis one
(statestore/store/cache.py), an LRU bounded by total bytes."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import NamedTuple

from statestore.content_keys import ContentSealer
from statestore.store.cache_entry import CachedHistory, CacheKey, appended
from statestore.store.thread_claims import Settle

_MIB = 1024 * 1024

# Rough per-entry cost of the dict slot, the tuple and the key string, charged against the budget
# so that a great many tiny entries are bounded too.
_ENTRY_OVERHEAD = 128
_SWEEP_INTERVAL_MS = 60_000


def _monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


class _Entry(NamedTuple):
    messages: int
    joined: bytes
    expires_at_ms: int
    version: int | None = None
    # The count as a SealedCache wrote it (store/sealed_cache.py); None for a clear entry. Each reads only its own.
    raw_count: bytes | None = None


class MemoryHistoryCache:
    """In-process history cache for the embedded default (no Redis): an LRU bounded by total bytes.

    Not thread-safe and needs no locks: it is used from one event loop and no method awaits, so each
    call runs to completion without interleaving. Expired entries are misses; they are dropped when
    touched, and a sweep at most once a minute drops the untouched ones.
    """

    def __init__(self, max_bytes: int = 256 * _MIB, *, clock: Callable[[], int] = _monotonic_ms) -> None:
        self._max_bytes = max_bytes
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0
        self._next_sweep_ms = clock() + _SWEEP_INTERVAL_MS
        self.errors = 0  # never incremented; present so metrics can read any cache alike

    @property
    def kind(self) -> str:
        return "memory"

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def _live(self, thread_id: str, now: int) -> _Entry | None:
        entry = self._entries.get(thread_id)
        if entry is None:
            return None
        if entry.expires_at_ms <= now:
            self._remove(thread_id)
            return None
        return entry

    def _remove(self, thread_id: str) -> None:
        entry = self._entries.pop(thread_id, None)
        if entry is not None:
            self._bytes -= len(entry.joined) + _ENTRY_OVERHEAD

    def _store(self, thread_id: str, entry: _Entry, now: int) -> None:
        self._remove(thread_id)
        size = len(entry.joined) + _ENTRY_OVERHEAD
        if size > self._max_bytes:
            return  # would evict everything else and still not fit
        if now >= self._next_sweep_ms:
            self._sweep(now)
        self._entries[thread_id] = entry
        self._bytes += size
        while self._bytes > self._max_bytes:
            oldest = next(iter(self._entries))
            self._remove(oldest)

    def _sweep(self, now: int) -> None:
        self._next_sweep_ms = now + _SWEEP_INTERVAL_MS
        for thread_id in [key for key, entry in self._entries.items() if entry.expires_at_ms <= now]:
            self._remove(thread_id)

    async def get(self, key: CacheKey) -> CachedHistory | None:
        name = key.name
        entry = self._live(name, self._clock())
        if entry is None or entry.raw_count is not None:
            return None
        self._entries.move_to_end(name)
        return CachedHistory(entry.messages, entry.joined, entry.version)

    async def put(
        self, key: CacheKey, history: CachedHistory, ttl_ms: int, *, sealer: ContentSealer, then: Settle | None = None
    ) -> None:
        # `then` (a commit's row and claim) is a claiming Redis's: claims need Redis, so this cache is never given one.
        if ttl_ms <= 0:
            self._remove(key.name)
            return
        now = self._clock()
        self._store(key.name, _Entry(history.count, history.joined, now + ttl_ms, history.version), now)

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
        now = self._clock()
        name = key.name
        entry = self._live(name, now)
        if entry is None:
            return
        # As in Redis: only an entry of no version is appended to (nothing appends to a versioned one).
        if entry.messages != expected_count or entry.version is not None or entry.raw_count is not None or ttl_ms <= 0:
            self._remove(name)
            return
        joined = appended(entry.joined, added)
        count = entry.messages + len(added) if new_count is None else new_count
        self._store(name, _Entry(count, joined, now + ttl_ms), now)

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
        now = self._clock()
        entry = self._live(old.name, now)
        self._remove(old.name)
        if (
            entry is None
            or entry.messages != expected_count
            or entry.version is not None
            or entry.raw_count is not None
            or ttl_ms <= 0
        ):
            return False
        joined = appended(entry.joined, added)
        self._store(new.name, _Entry(entry.messages + len(added), joined, now + ttl_ms), now)
        return True

    # -- the frame store of a SealedCache: raw bytes under a count string, compared exactly as the Redis scripts do --

    async def get_raw(self, key: CacheKey) -> tuple[bytes, bytes] | None:
        name = key.name
        entry = self._live(name, self._clock())
        if entry is None or entry.raw_count is None:
            return None
        self._entries.move_to_end(name)
        return entry.raw_count, entry.joined

    async def put_raw(self, key: CacheKey, count: bytes, data: bytes, ttl_ms: int) -> None:
        if ttl_ms <= 0:
            self._remove(key.name)
            return
        now = self._clock()
        self._store(key.name, _Entry(-1, data, now + ttl_ms, raw_count=count), now)

    async def append_raw(self, key: CacheKey, expected: bytes, count: bytes, tail: bytes, ttl_ms: int) -> None:
        now = self._clock()
        name = key.name
        entry = self._live(name, now)
        if entry is None:
            return
        if entry.raw_count != expected or ttl_ms <= 0:
            self._remove(name)
            return
        self._store(name, _Entry(-1, entry.joined + tail, now + ttl_ms, raw_count=count), now)

    async def move_raw(
        self, old: CacheKey, new: CacheKey, *, expected: bytes, count: bytes, tail: bytes, ttl_ms: int
    ) -> bool:
        now = self._clock()
        entry = self._live(old.name, now)
        self._remove(old.name)
        if entry is None or entry.raw_count != expected or ttl_ms <= 0:
            return False
        self._store(new.name, _Entry(-1, entry.joined + tail, now + ttl_ms, raw_count=count), now)
        return True

    async def delete(self, key: CacheKey) -> bool:
        self._remove(key.name)
        return True

    async def delete_many(self, keys: Sequence[CacheKey]) -> bool:
        for key in keys:
            self._remove(key.name)
        return True

    async def ping(self) -> bool:
        return True

    async def aclose(self) -> None:
        self._entries.clear()
        self._bytes = 0
