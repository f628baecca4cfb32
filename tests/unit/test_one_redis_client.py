"""statestore speaks to Redis through its own client only (store/resp.py, store/resp_cluster.py): redis-py is a test
dependency, never imported by the server, whichever Redis set-up it is given. A process holds one such client
(statestore/resources.py), shared by the history cache and the background events, each call bound by its own kind's
timeout."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import hiredis
import pytest

from statestore.config import Settings
from statestore.resources import build_resources
from statestore.store.cache_entry import thread_key
from statestore.store.event_log import RedisEventLog
from statestore.store.redis_cache import RedisHistoryCache

_IMPORTS = """
import sys
import statestore.app, statestore.cli, statestore.resources
from statestore.store.event_log import create_event_log
from statestore.store.cache_setup import create_cache
from statestore.store.resp_cluster import redis_client
create_cache(redis_client("redis://127.0.0.1:1/0?cluster=1"), "p:")
create_event_log(redis_client("redis://127.0.0.1:1/0"), "p:", cap=10)
print(sorted(name for name in sys.modules if name == "redis" or name.startswith("redis.")))
"""


def test_the_server_never_imports_redis_py() -> None:
    done = subprocess.run([sys.executable, "-c", _IMPORTS], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"


class FakeRedis:
    """Enough of Redis for a cache read and the event log's reads, each answered after `delay_s[command]`; counts the
    connections it is opened."""

    def __init__(self) -> None:
        self.connections = 0
        self.delay_s: dict[bytes, float] = {}
        self.port = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        parser = hiredis.Reader()
        while data := await reader.read(65536):
            parser.feed(data)
            while (command := parser.gets()) is not False:
                name = command[0].upper()
                await asyncio.sleep(self.delay_s.get(name, 0.0))
                if name == b"PING":
                    writer.write(b"+PONG\r\n")
                elif name == b"MGET":
                    writer.write(b"*%d\r\n" % (len(command) - 1) + b"$-1\r\n" * (len(command) - 1))
                elif name == b"XREAD":
                    writer.write(b"*-1\r\n")
                else:  # XRANGE, XREVRANGE: no events
                    writer.write(b"*0\r\n")
        writer.close()


@pytest.fixture
async def fake_redis() -> AsyncIterator[FakeRedis]:
    fake = FakeRedis()
    server = await asyncio.start_server(fake.serve, "127.0.0.1", 0)
    fake.port = server.sockets[0].getsockname()[1]
    yield fake
    server.close()


async def test_a_process_holds_one_client_for_the_cache_and_the_event_log(
    fake_redis: FakeRedis, tmp_path: Path
) -> None:
    settings = Settings(
        database_url=f"sqlite+aiosqlite:///{tmp_path / 'one.db'}",
        redis_url=f"redis://127.0.0.1:{fake_redis.port}/0",
        chat_upstream_url="http://127.0.0.1:1/v1",
    )
    async with build_resources(settings, serving=False) as built:
        assert built.background is not None
        cache, events = built.cache, built.background.events
        assert isinstance(cache, RedisHistoryCache) and isinstance(events, RedisEventLog)
        assert await cache.ping()
        assert await events.last("resp_a") is None
        assert await events.read("resp_a", -1, block_ms=0) == []
        assert await cache.get(thread_key("thr_a")) is None
        # One pool: the cache's and the event log's commands, one at a time, went on one connection.
        assert fake_redis.connections == 1
        # A follower's blocking read waits on a connection of its own, so it holds up no cache command.
        waiting = asyncio.ensure_future(events.read("resp_a", -1, block_ms=300))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        assert await cache.ping()
        assert time.monotonic() - started < 0.2
        assert await waiting == []
        assert fake_redis.connections == 2

        # Each kind of call is bound by its own timeout: the event log waits out a slow second, the cache does not.
        fake_redis.delay_s[b"XREVRANGE"] = 1.0
        assert await events.last("resp_a") is None
        fake_redis.delay_s[b"MGET"] = 1.0
        started = time.monotonic()
        assert await cache.get(thread_key("thr_a")) is None
        assert 0.4 < time.monotonic() - started < 0.95
        assert cache.errors == 1
