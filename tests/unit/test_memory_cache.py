"""History cache without a live service: the in-process cache's expiry and eviction, and the Redis cache's settings
refused before it connects. The contract both caches keep, on a real Redis, is tests/integration/test_cache.py."""

from __future__ import annotations

import pytest

from statestore.content_keys import CLEAR
from statestore.store.cache_entry import CachedHistory, thread_key
from statestore.store.memory_cache import MemoryHistoryCache
from statestore.store.redis_cache import RedisHistoryCache
from statestore.store.resp import split_cluster_flag
from statestore.store.resp_cluster import redis_client

TTL_MS = 60_000
M1, M2 = b'{"role":"user","content":"a"}', b'{"role":"assistant","content":"b"}'


class FakeClock:
    def __init__(self) -> None:
        self.now_ms = 1_000_000

    def __call__(self) -> int:
        return self.now_ms


async def test_memory_entry_expires_with_clock() -> None:
    clock = FakeClock()
    cache = MemoryHistoryCache(clock=clock)
    await cache.put(thread_key("thr_a"), CachedHistory(1, M1), 1_000, sealer=CLEAR)
    clock.now_ms += 999
    assert await cache.get(thread_key("thr_a")) == CachedHistory(1, M1)
    clock.now_ms += 1
    assert await cache.get(thread_key("thr_a")) is None
    assert len(cache) == 0 and cache.size_bytes == 0
    await cache.put(thread_key("thr_a"), CachedHistory(1, M1), 1_000, sealer=CLEAR)
    clock.now_ms += 1_000
    await cache.append(thread_key("thr_a"), 1, [M2], 1_000, sealer=CLEAR)  # expired: a miss, not an append
    assert await cache.get(thread_key("thr_a")) is None


async def test_memory_sweep_drops_untouched_expired_entries() -> None:
    clock = FakeClock()
    cache = MemoryHistoryCache(clock=clock)
    await cache.put(thread_key("thr_old"), CachedHistory(1, M1), 1_000, sealer=CLEAR)
    clock.now_ms += 61_000
    await cache.put(thread_key("thr_new"), CachedHistory(1, M2), 1_000, sealer=CLEAR)
    assert len(cache) == 1


def test_prefix_with_brace_is_refused() -> None:
    with pytest.raises(ValueError, match="prefix"):
        RedisHistoryCache(redis_client("redis://127.0.0.1:6379/0"), "ss{x}:")


async def test_memory_lru_eviction_by_bytes() -> None:
    cache = MemoryHistoryCache(max_bytes=3 * (1_000 + 128))  # room for three 1000-byte entries
    blob = b"x" * 1_000
    for name in ("a", "b", "c"):
        await cache.put(thread_key(name), CachedHistory(1, blob), TTL_MS, sealer=CLEAR)
    assert await cache.get(thread_key("a")) is not None  # now most recently used: "b" goes first
    await cache.put(thread_key("d"), CachedHistory(1, blob), TTL_MS, sealer=CLEAR)
    assert await cache.get(thread_key("b")) is None
    assert all([await cache.get(thread_key(name)) is not None for name in ("a", "c", "d")])
    assert cache.size_bytes <= 3 * (1_000 + 128)
    await cache.append(thread_key("a"), 1, [blob], TTL_MS, sealer=CLEAR)  # growing "a" pushes out the least recent
    assert await cache.get(thread_key("a")) == CachedHistory(2, blob + b"," + blob)
    assert await cache.get(thread_key("c")) is None
    await cache.put(thread_key("huge"), CachedHistory(1, b"y" * 10_000), TTL_MS, sealer=CLEAR)  # larger than the budget
    assert await cache.get(thread_key("huge")) is None
    assert await cache.get(thread_key("a")) is not None


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://h:6379/0", ("redis://h:6379/0", False)),
        ("redis://h:6379/0?cluster=1", ("redis://h:6379/0", True)),
        ("redis://u:p%40ss@h/0?socket_keepalive=1&cluster=true", ("redis://u:p%40ss@h/0?socket_keepalive=1", True)),
        ("redis://h/0?cluster=0", ("redis://h/0", False)),
    ],
)
def test_cluster_flag(url: str, expected: tuple[str, bool]) -> None:
    assert split_cluster_flag(url) == expected


def test_cluster_flag_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="cluster"):
        split_cluster_flag("redis://h/0?cluster=maybe")
