"""History cache: both implementations against the same contract, Redis ones on a real server.

Redis is shared with other tests and people, so each test works under its own `sstest:<uuid>:` prefix
and deletes its keys afterwards. An unreachable Redis fails these tests; it never skips them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest
from redis.asyncio import Redis
from redis.crc import key_slot

from statestore.content_keys import CLEAR
from statestore.store.cache import HistoryCache
from statestore.store.cache_entry import CachedHistory, CacheKey, thread_key
from statestore.store.cache_setup import create_cache
from statestore.store.memory_cache import MemoryHistoryCache
from statestore.store.redis_cache import RedisHistoryCache
from statestore.store.resp import COMMAND_TIMEOUT_S, RedisClient
from statestore.store.resp_cluster import ClusterClient, redis_client

REDIS_URL = os.environ.get("STATESTORE_TEST_REDIS", "redis://127.0.0.1:6379/0")
TTL_MS = 60_000
M1, M2, M3 = b'{"role":"user","content":"a"}', b'{"role":"assistant","content":"b"}', b'{"role":"user","content":"c"}'


class FakeClock:
    def __init__(self) -> None:
        self.now_ms = 1_000_000

    def __call__(self) -> int:
        return self.now_ms


@dataclass
class Harness:
    cache: HistoryCache
    clock: FakeClock
    raw: Redis | None  # a plain client on the same Redis, to look behind the cache's back
    prefix: str

    async def remaining_ttl_ms(self, thread_id: CacheKey) -> list[int]:
        if self.raw is None:
            assert isinstance(self.cache, MemoryHistoryCache)
            entry = self.cache._entries[thread_id.name]
            return [entry.expires_at_ms - self.clock()]
        return [await self.raw.pttl(f"{self.prefix}{{{thread_id}}}:{kind}") for kind in ("h", "n")]


_clients: list[RedisClient] = []


def redis_cache(url: str, prefix: str, *, timeout_s: float = COMMAND_TIMEOUT_S) -> RedisHistoryCache:
    """A cache on a client of its own, as a process builds one (statestore/resources.py), closed after the test."""
    client = redis_client(url, timeout_s=timeout_s)
    _clients.append(client)
    return RedisHistoryCache(client, prefix)


@pytest.fixture(autouse=True)
async def close_clients() -> AsyncIterator[None]:
    yield
    while _clients:
        await _clients.pop().aclose()


@pytest.fixture
async def raw_redis() -> AsyncIterator[Redis]:
    client = Redis.from_url(REDIS_URL)
    await client.ping()  # raises if Redis is unreachable: a failure, not a skip
    yield client
    await client.aclose()


@pytest.fixture
async def prefix(raw_redis: Redis) -> AsyncIterator[str]:
    prefix = f"sstest:{uuid.uuid4().hex}:"
    yield prefix
    keys = [key async for key in raw_redis.scan_iter(match=f"{prefix}*", count=1000)]
    if keys:
        await raw_redis.delete(*keys)


@pytest.fixture(params=["redis", "memory"])
async def harness(request: pytest.FixtureRequest, raw_redis: Redis, prefix: str) -> AsyncIterator[Harness]:
    clock = FakeClock()
    cache: HistoryCache
    if request.param == "redis":
        cache = redis_cache(REDIS_URL, prefix)
        yield Harness(cache, clock, raw_redis, prefix)
        assert cache.errors == 0
    else:
        cache = MemoryHistoryCache(clock=clock)
        yield Harness(cache, clock, None, prefix)
    await cache.aclose()


def thread() -> CacheKey:
    return thread_key(f"thr_{uuid.uuid4().hex}")


async def test_put_get_round_trip(harness: Harness) -> None:
    cache, tid = harness.cache, thread()
    assert await cache.get(tid) is None
    await cache.put(tid, CachedHistory(2, M1 + b"," + M2), TTL_MS, sealer=CLEAR)
    assert await cache.get(tid) == CachedHistory(2, M1 + b"," + M2)
    await cache.put(tid, CachedHistory(0, b""), TTL_MS, sealer=CLEAR)
    assert await cache.get(tid) == CachedHistory(0, b"")
    assert await cache.ping()


async def test_append_with_matching_count(harness: Harness) -> None:
    cache, tid = harness.cache, thread()
    await cache.put(tid, CachedHistory(0, b""), TTL_MS, sealer=CLEAR)
    await cache.append(tid, 0, [M1], TTL_MS, sealer=CLEAR)
    assert await cache.get(tid) == CachedHistory(1, M1)
    await cache.append(tid, 1, [M2, M3], TTL_MS, sealer=CLEAR)
    assert await cache.get(tid) == CachedHistory(3, b",".join([M1, M2, M3]))
    await cache.append(tid, 3, [], TTL_MS, sealer=CLEAR)
    assert await cache.get(tid) == CachedHistory(3, b",".join([M1, M2, M3]))


async def test_append_with_stale_count_deletes(harness: Harness) -> None:
    cache, tid = harness.cache, thread()
    await cache.put(tid, CachedHistory(1, M1), TTL_MS, sealer=CLEAR)
    await cache.append(tid, 2, [M3], TTL_MS, sealer=CLEAR)
    assert await cache.get(tid) is None
    await cache.put(tid, CachedHistory(1, M1), TTL_MS, sealer=CLEAR)
    await cache.append(tid, 0, [M3], TTL_MS, sealer=CLEAR)
    assert await cache.get(tid) is None


async def test_append_with_a_count_of_the_callers_own(harness: Harness) -> None:
    """A conversation counts its position, not joined messages: the appended entry records the given count."""
    cache, key = harness.cache, thread()
    await cache.put(key, CachedHistory(5, M1), TTL_MS, sealer=CLEAR)
    await cache.append(key, 5, [M2 + b"," + M3], TTL_MS, new_count=9, sealer=CLEAR)
    assert await cache.get(key) == CachedHistory(9, b",".join([M1, M2, M3]))
    await cache.append(key, 5, [M1], TTL_MS, new_count=7, sealer=CLEAR)  # stale: dropped
    assert await cache.get(key) is None


async def test_move_hands_an_entry_to_a_new_key_with_the_addition(harness: Harness) -> None:
    cache, parent, head = harness.cache, thread(), thread()
    await cache.put(parent, CachedHistory(2, M1 + b"," + M2), TTL_MS, sealer=CLEAR)
    moved = await cache.move(parent, head, 2, [M3], 5_000, sealer=CLEAR)
    if isinstance(cache, RedisHistoryCache) and cache._cluster:
        assert not moved  # Cluster: the keys are in different slots; the caller puts instead
        return
    assert moved
    assert await cache.get(head) == CachedHistory(3, b",".join([M1, M2, M3]))
    assert await cache.get(parent) is None
    assert all(4_000 < ttl <= 5_000 for ttl in await harness.remaining_ttl_ms(head))
    # a stale or missing source moves nothing, and a stale one is dropped
    other = thread()
    assert not await cache.move(parent, other, 2, [M3], TTL_MS, sealer=CLEAR)
    assert not await cache.move(head, other, 2, [M3], TTL_MS, sealer=CLEAR)
    assert await cache.get(head) is None and await cache.get(other) is None


async def test_append_to_missing_entry_stays_missing(harness: Harness) -> None:
    cache, tid = harness.cache, thread()
    await cache.append(tid, 0, [M1], TTL_MS, sealer=CLEAR)
    assert await cache.get(tid) is None
    if harness.raw is not None:
        assert await harness.raw.exists(f"{harness.prefix}{{{tid}}}:h", f"{harness.prefix}{{{tid}}}:n") == 0


async def test_ttl_applied_and_refreshed(harness: Harness) -> None:
    cache, tid = harness.cache, thread()
    await cache.put(tid, CachedHistory(1, M1), 5_000, sealer=CLEAR)
    assert all(4_000 < ttl <= 5_000 for ttl in await harness.remaining_ttl_ms(tid))
    await cache.append(tid, 1, [M2], 20_000, sealer=CLEAR)
    assert all(19_000 < ttl <= 20_000 for ttl in await harness.remaining_ttl_ms(tid))
    await cache.put(tid, CachedHistory(1, M1), 0, sealer=CLEAR)  # a non-positive TTL stores nothing
    assert await cache.get(tid) is None


async def test_delete_and_delete_many(harness: Harness) -> None:
    cache = harness.cache
    ids = [thread() for _ in range(600)]  # more than one delete_many batch
    for tid in ids:
        await cache.put(tid, CachedHistory(1, M1), TTL_MS, sealer=CLEAR)
    await cache.delete(ids[0])
    assert await cache.get(ids[0]) is None
    assert await cache.get(ids[1]) == CachedHistory(1, M1)
    await cache.delete_many(ids[1:])
    await cache.delete_many([])
    for tid in ids:
        assert await cache.get(tid) is None
    if harness.raw is not None:
        assert [key async for key in harness.raw.scan_iter(match=f"{harness.prefix}*")] == []


async def test_keys_of_one_thread_share_a_slot(raw_redis: Redis, prefix: str) -> None:
    cache = redis_cache(REDIS_URL, prefix)
    tid = thread()
    await cache.put(tid, CachedHistory(1, M1), TTL_MS, sealer=CLEAR)
    keys = sorted([key async for key in raw_redis.scan_iter(match=f"{prefix}*")])
    assert keys == [f"{prefix}{{{tid}}}:h".encode(), f"{prefix}{{{tid}}}:n".encode()]
    assert key_slot(keys[0]) == key_slot(keys[1]) == key_slot(tid.name.encode())
    await cache.aclose()


async def test_unreachable_redis_behaves_like_a_miss(prefix: str) -> None:
    cache = redis_cache("redis://127.0.0.1:1/0", prefix, timeout_s=0.2)
    tid = thread()
    assert await cache.get(tid) is None
    await cache.put(tid, CachedHistory(1, M1), TTL_MS, sealer=CLEAR)
    await cache.append(tid, 1, [M2], TTL_MS, sealer=CLEAR)
    await cache.delete(tid)
    await cache.delete_many([tid, thread()])
    assert await cache.ping() is False
    assert cache.errors == 6
    await cache.aclose()


async def test_outage_logs_one_warning_per_burst_without_content(prefix: str, caplog: pytest.LogCaptureFixture) -> None:
    cache = redis_cache("redis://127.0.0.1:1/0", prefix)
    tid = thread()
    with caplog.at_level(logging.WARNING, logger="statestore.store.redis_cache"):
        for _ in range(5):
            await cache.put(tid, CachedHistory(1, M1), TTL_MS, sealer=CLEAR)
            await cache.append(tid, 1, [M2], TTL_MS, sealer=CLEAR)
    assert cache.errors == 10
    assert len(caplog.records) == 1
    assert tid.name in caplog.text
    assert "content" not in caplog.text  # the message bytes (M1, M2) never reach the log
    await cache.aclose()


async def test_hung_redis_times_out_to_a_miss(prefix: str) -> None:
    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(65536):
            pass
        writer.close()

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    cache = redis_cache(f"redis://127.0.0.1:{port}/0", prefix, timeout_s=0.1)
    started = time.monotonic()
    assert await cache.get(thread()) is None  # times out
    # Skipped at once: Redis failed moments ago (the breaker), and a skipped append leaves nothing to drop.
    await cache.append(thread(), 1, [M2], TTL_MS, sealer=CLEAR)
    assert cache.errors == 2
    assert time.monotonic() - started < 1
    await cache.aclose()
    server.close()


async def test_cluster_mode_against_a_standalone_redis_degrades_to_misses(prefix: str) -> None:
    cache = redis_cache(f"{REDIS_URL}{'&' if '?' in REDIS_URL else '?'}cluster=1", prefix)
    assert isinstance(cache._commands.client, ClusterClient)
    assert await cache.get(thread()) is None
    await cache.put(thread(), CachedHistory(1, M1), TTL_MS, sealer=CLEAR)
    assert await cache.ping() is False
    assert cache.errors == 3
    await cache.aclose()


async def test_a_burst_shares_connections_and_every_reply_reaches_its_request(prefix: str) -> None:
    """Many commands in flight on a few connections: Redis answers in order, and each caller gets its own reply."""
    cache = redis_cache(REDIS_URL, prefix)
    tids = [thread() for _ in range(200)]
    await asyncio.gather(
        *[
            cache.put(tid, CachedHistory(i + 1, b",".join([M1] * (i + 1))), TTL_MS, sealer=CLEAR)
            for i, tid in enumerate(tids)
        ]
    )
    results = await asyncio.gather(*[cache.get(tid) for tid in tids])
    assert results == [CachedHistory(i + 1, b",".join([M1] * (i + 1))) for i in range(len(tids))]
    assert cache.errors == 0
    await cache.aclose()


async def test_failed_write_inside_script_drops_the_entry(raw_redis: Redis, prefix: str) -> None:
    cache = redis_cache(REDIS_URL, prefix)
    tid = thread()
    await cache.put(tid, CachedHistory(1, M1), TTL_MS, sealer=CLEAR)
    # A wrong-typed bytes key makes APPEND fail after the count check passed: the script must not
    # leave the count describing bytes it did not write.
    await raw_redis.delete(f"{prefix}{{{tid}}}:h")
    await raw_redis.rpush(f"{prefix}{{{tid}}}:h", b"junk")
    await cache.append(tid, 1, [M2], TTL_MS, sealer=CLEAR)
    assert cache.errors == 1
    assert await raw_redis.exists(f"{prefix}{{{tid}}}:h", f"{prefix}{{{tid}}}:n") == 0
    assert await cache.get(tid) is None
    await cache.aclose()


async def test_inconsistent_keys_are_a_miss(raw_redis: Redis, prefix: str) -> None:
    cache = redis_cache(REDIS_URL, prefix)
    tid = thread()
    await raw_redis.set(f"{prefix}{{{tid}}}:h", M1, px=TTL_MS)
    assert await cache.get(tid) is None  # no count
    await raw_redis.set(f"{prefix}{{{tid}}}:n", b"0", px=TTL_MS)
    assert await cache.get(tid) is None  # count 0 with bytes
    await raw_redis.set(f"{prefix}{{{tid}}}:n", b"nope", px=TTL_MS)
    assert await cache.get(tid) is None
    await cache.aclose()


async def test_noscript_recovery(raw_redis: Redis, prefix: str) -> None:
    cache = redis_cache(REDIS_URL, prefix)
    tid = thread()
    await cache.put(tid, CachedHistory(1, M1), TTL_MS, sealer=CLEAR)
    await raw_redis.script_flush()
    await cache.append(tid, 1, [M2], TTL_MS, sealer=CLEAR)
    await raw_redis.script_flush()
    await cache.put(tid, CachedHistory(2, M1 + b"," + M2), TTL_MS, sealer=CLEAR)
    await cache.append(tid, 2, [M3], TTL_MS, sealer=CLEAR)
    assert await cache.get(tid) == CachedHistory(3, b",".join([M1, M2, M3]))
    assert cache.errors == 0
    await cache.aclose()


@pytest.mark.parametrize(("url", "kind"), [(None, "memory"), ("", "memory"), (REDIS_URL, "redis")])
async def test_create_cache(url: str | None, kind: str) -> None:
    factory: Callable[[RedisClient | None, str], HistoryCache] = create_cache
    cache = factory(redis_client(url) if url else None, "sstest:unused:")
    assert cache.kind == kind
    await cache.aclose()


async def test_transport_runtime_error_is_a_miss(prefix: str) -> None:
    """Found by the fault campaign: when a reset closes a Redis connection, uvloop raises RuntimeError for the next
    write on its transport before redis-py sees the connection is gone. That escaped the cache as a 500 (a turn
    already committed reported as failed, a stream cut before message_stop). Every cache call must take it as a
    miss."""
    cache = redis_cache(REDIS_URL, prefix)

    async def closed_transport(*args: object, **kwargs: object) -> object:
        raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")

    cache._commands.mget = closed_transport  # type: ignore[method-assign,assignment]
    cache._commands.delete = closed_transport  # type: ignore[method-assign,assignment]
    cache._commands.run = closed_transport  # type: ignore[method-assign]
    tid = thread()
    assert await cache.get(tid) is None
    await cache.put(tid, CachedHistory(1, M1), TTL_MS, sealer=CLEAR)
    await cache.append(tid, 1, [M2], TTL_MS, sealer=CLEAR)
    assert await cache.delete(tid) is False
    assert cache.errors == 5  # get, put, append and its DEL, delete
    await cache.aclose()
