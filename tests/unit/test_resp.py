"""The lean Redis client of the history cache (statestore/store/resp.py): URLs, replies matched to their requests,
a connection that dies or hangs. Against the real Redis, and against small servers of the test's own that misbehave
on purpose."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import uvloop
from redis.asyncio import Redis

from statestore.config import Settings
from statestore.store.resp import Endpoint, RespClient, RespError, Script, parse_url

REDIS_URL = os.environ.get("STATESTORE_TEST_REDIS", "redis://127.0.0.1:6379/0")


@pytest.mark.parametrize(
    ("url", "endpoint"),
    [
        ("redis://h", Endpoint("h", 6379, None, False, None, None, 0)),
        ("redis://h:7000/3", Endpoint("h", 7000, None, False, None, None, 3)),
        ("rediss://u:p%40ss@h/1", Endpoint("h", 6379, None, True, "u", "p@ss", 1)),
        ("redis://:secret@h", Endpoint("h", 6379, None, False, None, "secret", 0)),
        ("unix:///run/redis.sock?db=2", Endpoint(None, 0, "/run/redis.sock", False, None, None, 2)),
        ("redis://h/0?password=x&username=y", Endpoint("h", 6379, None, False, "y", "x", 0)),
    ],
)
def test_urls(url: str, endpoint: Endpoint) -> None:
    assert parse_url(url) == endpoint


@pytest.mark.parametrize(
    ("url", "problem"),
    [("redis://h/0?socket_keepalive=1", "socket_keepalive"), ("redis://h/zero", "number"), ("http://h", "redis")],
)
def test_urls_it_cannot_honour_are_refused(url: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_url(url)


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
    await raw.client_kill_filter(_id=own_id)
    await raw.aclose()
    await asyncio.sleep(0.05)
    assert await client.execute("SET", key, "v", "PX", 60_000) == b"OK"
    assert await client.execute("CLIENT", "ID") != own_id
    await client.aclose()


async def serve(handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]) -> asyncio.Server:
    return await asyncio.start_server(handler, "127.0.0.1", 0)


async def test_a_late_reply_is_never_given_to_the_next_request() -> None:
    """The first command's reply comes after its timeout: the connection is dropped, so that reply cannot be read as
    the answer to the second command, which a new connection answers."""
    connections = 0

    async def slow_then_fast(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        mine = connections
        while await reader.read(65536):
            if mine == 1:
                await asyncio.sleep(0.3)
            writer.write(b"$%d\r\nreply-of-connection-%d\r\n" % (len(b"reply-of-connection-") + 1, mine))
            await writer.drain()
        writer.close()

    server = await serve(slow_then_fast)
    port = server.sockets[0].getsockname()[1]
    client = RespClient(f"redis://127.0.0.1:{port}", timeout_s=0.1, connections=1)
    with pytest.raises(TimeoutError):
        await client.execute("GET", "a")
    assert await client.execute("GET", "b") == b"reply-of-connection-2"
    await client.aclose()
    server.close()


async def test_garbage_from_the_server_fails_the_commands_in_flight() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(65536)
        writer.write(b"?not resp\r\n")
        await writer.drain()
        await reader.read(65536)

    server = await serve(garbage)
    port = server.sockets[0].getsockname()[1]
    client = RespClient(f"redis://127.0.0.1:{port}", timeout_s=1, connections=1)
    with pytest.raises(ConnectionError):
        await client.execute("GET", "a")
    await client.aclose()
    server.close()


async def test_nothing_listening_is_a_connection_error() -> None:
    client = RespClient("redis://127.0.0.1:1", timeout_s=0.2)
    with pytest.raises(ConnectionError):
        await client.execute("PING")
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


def test_settings_refuse_a_redis_url_the_client_cannot_honour() -> None:
    """At start-up, naming the option, rather than as cache misses at the first turn."""
    with pytest.raises(ValueError, match="socket_keepalive"):
        Settings(redis_url="redis://127.0.0.1:6379/0?socket_keepalive=1")
    assert Settings(redis_url="redis://127.0.0.1:6379/0?cluster=1&socket_keepalive=1").redis_url is not None
