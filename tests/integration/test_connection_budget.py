"""The PostgreSQL connection budget of one process (docs/deployment.md, "Sizing"): at most 1.5 x
STATESTORE_DATABASE_POOL_SIZE connections to the database, under traffic on both doors with background runs and the
purger at work, counted by the server itself (pg_stat_activity) while the traffic runs. The SQLite set-up opens no
connection to a server, so there is nothing to count there."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Iterator

import anthropic
import asyncpg
import openai
import pytest
from sqlalchemy.engine import make_url

from tests.support.fake_backend import FakeBackend
from tests.support.redis_keys import own_redis_prefix
from tests.support.server import StatestoreServer

POOL_SIZE = 8
BUDGET = POOL_SIZE * 3 // 2
THREADS_BETA = "message-threads-2026-08-12"
TTL_SECONDS = 5


@pytest.fixture
async def database(postgres_admin_url: str) -> AsyncIterator[str]:
    from tests.conftest import migrated_scratch_pg_database

    async with migrated_scratch_pg_database(postgres_admin_url) as url:
        yield url


@pytest.fixture
def server(database: str, redis_url: str, fake_backend_process: FakeBackend) -> Iterator[StatestoreServer]:
    with own_redis_prefix(redis_url) as prefix:
        server = StatestoreServer(
            database_url=database,
            upstream_url=fake_backend_process.url,
            redis_url=redis_url,
            redis_prefix=prefix,
            env={
                "STATESTORE_CHAT_UPSTREAM_URL": fake_backend_process.url,
                "STATESTORE_DATABASE_POOL_SIZE": str(POOL_SIZE),
                "STATESTORE_DEFAULT_TTL_SECONDS": str(TTL_SECONDS),
                "STATESTORE_PURGE_INTERVAL_SECONDS": "0.2",
                "STATESTORE_BACKGROUND_POLL_SECONDS": "0.1",
                "STATESTORE_LOG_LEVEL": "WARNING",
            },
        )
        try:
            yield server
        finally:
            server.stop()


async def _thread(claude: anthropic.AsyncAnthropic, turns: int) -> None:
    thread = claude.beta.messages.thread(model="echo-1", max_tokens=64, betas=[THREADS_BETA])
    for n in range(turns):
        await thread.send({"role": "user", "content": f"turn {n}"})


async def _chain(client: openai.AsyncOpenAI, turns: int) -> None:
    previous: str | None = None
    for n in range(turns):
        response = await client.responses.create(model="echo-1", input=f"turn {n}", previous_response_id=previous)
        previous = response.id


async def _conversation(client: openai.AsyncOpenAI, turns: int) -> None:
    conversation = await client.conversations.create()
    for n in range(turns):
        await client.responses.create(model="echo-1", input=f"turn {n}", conversation=conversation.id)


async def _background(client: openai.AsyncOpenAI) -> None:
    queued = await client.responses.create(model="echo-1", input="in the background", background=True)
    async with asyncio.timeout(60):
        while (await client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
            await asyncio.sleep(0.05)
    assert (await client.responses.retrieve(queued.id)).status == "completed"


async def _traffic(url: str, api_key: str, width: int) -> None:
    async with (
        anthropic.AsyncAnthropic(base_url=url, api_key=api_key, max_retries=0, timeout=60) as claude,
        openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=60) as client,
    ):
        await asyncio.gather(
            *(_thread(claude, 3) for _ in range(width)),
            *(_chain(client, 3) for _ in range(width)),
            *(_conversation(client, 2) for _ in range(width // 4)),
            *(_background(client) for _ in range(width // 4)),
        )


async def test_one_process_stays_within_one_and_a_half_pools(
    server: StatestoreServer, database: str, postgres_admin_url: str
) -> None:
    name = make_url(database).database
    admin = await asyncpg.connect(make_url(postgres_admin_url).set(drivername="postgresql").render_as_string(False))
    seen: list[int] = []
    done = asyncio.Event()

    async def count() -> None:
        while not done.is_set():
            seen.append(await admin.fetchval("SELECT count(*) FROM pg_stat_activity WHERE datname = $1", name))
            await asyncio.sleep(0.01)

    counting = asyncio.create_task(count())
    try:
        api_key = f"sk-test-{secrets.token_hex(8)}"
        # A first wave the purger will find expired while the second runs.
        await _traffic(server.url, api_key, 8)
        await asyncio.sleep(TTL_SECONDS + 0.5)
        await _traffic(server.url, api_key, 32)
        await asyncio.sleep(0.5)  # a purge and a background poll after the traffic
    finally:
        done.set()
        await counting
        await admin.close()
    own = await asyncpg.connect(make_url(database).set(drivername="postgresql").render_as_string(False))
    try:
        left = await own.fetchval("SELECT count(*) FROM threads")
    finally:
        await own.close()
    assert left <= 32, left  # the purger ran beside the traffic: the first wave's 8 threads are gone
    print(f"at most {max(seen)} connections at a pool size of {POOL_SIZE}")
    assert max(seen) <= BUDGET, f"{max(seen)} connections at a pool size of {POOL_SIZE}: {sorted(seen)[-10:]}"
    assert max(seen) > POOL_SIZE // 2, seen  # the traffic did use the pools
