"""Replicas of two releases share one Redis during a rolling upgrade: an entry of the format before (a bare count) is
served as it is, appended to only after it is written again in this release's format, and an entry of a format this
release does not know is a miss. Against a real Redis, under a prefix of the test's own."""

from __future__ import annotations

import uuid

import pytest
from redis.asyncio import Redis

from statestore.content_keys import CLEAR
from statestore.store.cache_entry import CachedHistory, thread_key
from statestore.store.redis_cache import RedisHistoryCache
from statestore.store.resp_cluster import redis_client

TTL_MS = 60_000
M1, M2 = b'{"role":"user","content":"a"}', b'{"role":"assistant","content":"b"}'


@pytest.fixture
async def raw(redis_url: str) -> Redis:
    return Redis.from_url(redis_url)


async def test_each_format_is_read_or_missed_as_it_should_be(raw: Redis, redis_url: str, redis_prefix: str) -> None:
    client = redis_client(redis_url)
    cache = RedisHistoryCache(client, redis_prefix)
    thread = thread_key(f"thr_{uuid.uuid4().hex}")
    joined, count = f"{redis_prefix}{{{thread.name}}}:h", f"{redis_prefix}{{{thread.name}}}:n"
    try:
        # As the release before formats wrote it.
        await raw.set(joined, M1, px=TTL_MS)
        await raw.set(count, b"1", px=TTL_MS)
        assert await cache.get(thread) == CachedHistory(1, M1)
        # Its count is not this release's string: the append drops it, and the next turn rebuilds it.
        await cache.append(thread, 1, [M2], TTL_MS, sealer=CLEAR)
        assert await cache.get(thread) is None
        await cache.put(thread, CachedHistory(1, M1), TTL_MS, sealer=CLEAR)
        assert await raw.get(count) == b"2:1"
        await cache.append(thread, 1, [M2], TTL_MS, sealer=CLEAR)
        assert await cache.get(thread) == CachedHistory(2, M1 + b"," + M2)
        # A later release's format is not served.
        await raw.set(count, b"3:2", px=TTL_MS)
        assert await cache.get(thread) is None
        # The version travels apart from the count, and a versioned entry is never appended to.
        await cache.put(thread, CachedHistory(2, M1 + b"," + M2, version=7), TTL_MS, sealer=CLEAR)
        assert await raw.get(count) == b"2:2:7"
        assert await cache.get(thread) == CachedHistory(2, M1 + b"," + M2, 7)
        await cache.append(thread, 2, [M1], TTL_MS, sealer=CLEAR)
        assert await cache.get(thread) is None
        assert cache.errors == 0
    finally:
        await client.aclose()
        await raw.aclose()
