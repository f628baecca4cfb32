"""The lean Redis client of the history cache (statestore/store/resp.py) without a live Redis: URLs, and replies
matched to their requests against small servers of the test's own that misbehave on purpose (a late reply, garbage,
nothing listening). Against the real Redis: tests/integration/test_resp.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from statestore.config import Settings
from statestore.store.resp import Endpoint, RedisBreaker, RedisSkipped, RespClient, pack, parse_url


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


def test_a_command_is_framed_in_resp2_whatever_its_arguments() -> None:
    """Bytes as they are, text as UTF-8, integers in decimal (negative too), an empty value, a value holding CRLF and
    NUL, and one of a megabyte: each a bulk string of its exact length."""
    large = b"\r\n\x00" * 350_000
    assert pack(["SET", "café ☕", -5, b"", large]) == (
        b"*5\r\n$3\r\nSET\r\n$9\r\ncaf\xc3\xa9 \xe2\x98\x95\r\n$2\r\n-5\r\n$0\r\n\r\n"
        + b"$1050000\r\n"
        + large
        + b"\r\n"
    )
    assert pack((b"GET", 2**40)) == b"*2\r\n$3\r\nGET\r\n$13\r\n1099511627776\r\n"


@pytest.mark.parametrize(
    ("url", "problem"),
    [("redis://h/0?socket_keepalive=1", "socket_keepalive"), ("redis://h/zero", "number"), ("http://h", "redis")],
)
def test_urls_it_cannot_honour_are_refused(url: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_url(url)


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
    # The breaker off (a pause of 0): the second command is sent at once, not skipped.
    client = RespClient(f"redis://127.0.0.1:{port}", timeout_s=0.1, connections=1, breaker=RedisBreaker(0.0, 0.0))
    with pytest.raises(TimeoutError):
        await client.execute("GET", "a")
    assert await client.execute("GET", "b") == b"reply-of-connection-2"
    await client.aclose()
    server.close()


async def test_after_a_timeout_redis_is_skipped_for_a_pause_then_probed() -> None:
    """A Redis that accepts and does not answer: the first command waits its timeout, the next ones are skipped at once
    until the pause is over; then one command probes (the others still skip), and an answer ends the pause."""
    answering = False

    async def hung_until_told(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(65536):
            if answering:
                writer.write(b"+PONG\r\n")
                await writer.drain()
        writer.close()

    server = await serve(hung_until_told)
    port = server.sockets[0].getsockname()[1]
    client = RespClient(f"redis://127.0.0.1:{port}", timeout_s=0.1, breaker=RedisBreaker(0.3, 1.0))
    with pytest.raises(TimeoutError):
        await client.execute("PING")
    started = time.monotonic()
    for _ in range(20):
        with pytest.raises(RedisSkipped):
            await client.execute("PING")
    assert time.monotonic() - started < 0.05
    await asyncio.sleep(0.35)
    answering = True
    probe = asyncio.ensure_future(client.execute("PING"))
    await asyncio.sleep(0)  # the probe is on its way: the others still skip until it settles
    with pytest.raises(RedisSkipped):
        await client.execute("PING")
    assert await probe == b"PONG"
    assert await client.execute("PING") == b"PONG"
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


def test_settings_refuse_a_redis_url_the_client_cannot_honour() -> None:
    """At start-up, naming the option, rather than as cache misses at the first turn."""
    with pytest.raises(ValueError, match="socket_keepalive"):
        Settings(redis_url="redis://127.0.0.1:6379/0?socket_keepalive=1")
    with pytest.raises(ValueError, match="socket_keepalive"):
        Settings(redis_url="redis://127.0.0.1:6379/0?cluster=1&socket_keepalive=1")
    with pytest.raises(ValueError, match="only database 0"):
        Settings(redis_url="redis://127.0.0.1:6379/2?cluster=1")
    assert Settings(redis_url="redis://127.0.0.1:6379/0?cluster=1").redis_url is not None
