"""The lean Redis client of the history cache (statestore/store/resp.py) against the real Redis: replies and error
replies, scripts, a connection Redis kills, and uvloop's transports. Its URLs and its behaviour against misbehaving
servers of the test's own are tests/unit/test_resp.py."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator

import pytest
import uvloop
from redis.asyncio import Redis

from statestore.store.resp import RespClient, Script
from statestore.store.resp_reader import RespError

REDIS_URL = os.environ.get("STATESTORE_TEST_REDIS", "redis://127.0.0.1:6379/0")


@pytest.fixture
async def key() -> AsyncIterator[str]:
    name = f"sstest:{uuid.uuid4().hex}:resp"
    yield name
    raw = Redis.from_url(REDIS_URL)
    await raw.delete(name)
    await raw.aclose()


async def test_commands_replies_and_error_replies(key: str) -> None:
    client = RespClient(REDIS_URL)
    assert await client.execute("SET", key, b"\x00\r\nbinary", "PX", 60_000) == b"OK"
    assert await client.execute("MGET", key, key + ":missing") == [b"\x00\r\nbinary", None]
    with pytest.raises(RespError, match="WRONGTYPE"):
        await client.execute("LPUSH", key, "x")
    # An error reply fails its own command only; the connection goes on.
    assert await client.execute("APPEND", key, "!") == len(b"\x00\r\nbinary!")
    await client.aclose()


async def test_a_script_unknown_to_redis_is_loaded_and_run(key: str) -> None:
    client = RespClient(REDIS_URL)
    script = Script(f"-- {uuid.uuid4().hex}\nreturn redis.call('INCRBY', KEYS[1], ARGV[1])")
    assert await script.run(client, [key], [5]) == 5  # NOSCRIPT first, then EVAL
    assert await script.run(client, [key], [2]) == 7  # now by its SHA1
    await client.aclose()


async def test_a_connection_killed_by_redis_is_replaced(key: str) -> None:
    client = RespClient(REDIS_URL, connections=1)
    own_id = await client.execute("CLIENT", "ID")
    raw = Redis.from_url(REDIS_URL)
    (killed,) = [conn for conn in client._slots if conn is not None]
    await raw.client_kill_filter(_id=own_id)
    await raw.aclose()
    async with asyncio.timeout(5):
        while not killed.closed:  # until the end of the socket reaches the client
            await asyncio.sleep(0.005)
    assert await client.execute("SET", key, "v", "PX", 60_000) == b"OK"
    assert await client.execute("CLIENT", "ID") != own_id
    await client.aclose()


def test_under_uvloop(key: str) -> None:
    """uvloop serves statestore, and its transports differ from asyncio's in ways that have mattered (they are not
    asyncio.Transport subclasses). The tests above run on the suite's asyncio loop; this one on uvloop."""

    async def round_trip() -> tuple[object, list[object]]:
        client = RespClient(REDIS_URL)
        try:
            await client.execute("SET", key, b"v", "PX", 60_000)
            return await client.execute("MGET", key), await client.pipeline([("GET", key), ("LPUSH", key, "x")])
        finally:
            await client.aclose()

    values, (value, error) = uvloop.run(round_trip())
    assert values == [b"v"] and value == b"v" and isinstance(error, RespError)
