"""Encryption at rest through the Responses door: with STATESTORE_ENCRYPTION_KEYS set, chains, conversations,
background turns and compaction round-trip through the official SDK on PostgreSQL with Redis and on SQLite, while no
content byte lies in clear in the door's tables or in Redis (its event streams included); a stored item copied to
another position or another owner's row does not open (a 500 that names no content). The history cache's entries
(store/sealed_cache.py) are in the Redis scan too."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator
from typing import Any

import openai
import pytest
import redis
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from statestore.core.planner import DEFAULT_SUMMARY_INSTRUCTIONS
from statestore.sealing import new_key_text
from tests.integration.responses.test_background import final, raw_events
from tests.support.fake_backend import FakeBackend
from tests.support.redis_keys import own_redis_prefix
from tests.support.server import StatestoreServer

# Every column of the door's tables that holds content.
CONTENT_COLUMNS = {
    "responses": ("body", "context_head"),
    "response_items": ("body", "rendered"),
    "conversations": ("metadata",),
    "conversation_items": ("body", "rendered"),
    "background_responses": ("request", "headers", "body"),
}
SUMMARY_MARKER = DEFAULT_SUMMARY_INSTRUCTIONS[:40]


@pytest.fixture(scope="module")
async def sealed_pg_url(postgres_admin_url: str) -> AsyncIterator[str]:
    from tests.conftest import migrated_scratch_pg_database

    async with migrated_scratch_pg_database(postgres_admin_url) as url:
        yield url


@pytest.fixture(scope="module")
def sealed_prefix(redis_url: str) -> Iterator[str]:
    with own_redis_prefix(redis_url) as prefix:
        yield prefix


def _env(backend: FakeBackend) -> dict[str, str]:
    return {"STATESTORE_CHAT_UPSTREAM_URL": backend.url, "STATESTORE_ENCRYPTION_KEYS": f"k1:{new_key_text()}"}


@pytest.fixture(scope="module")
def sealed_servers(
    sealed_pg_url: str,
    redis_url: str,
    sealed_prefix: str,
    fake_backend_process: FakeBackend,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, tuple[StatestoreServer, str]]]:
    """An encrypted server on PostgreSQL and Redis, and one on SQLite: each with its database's URL."""
    from statestore.store.migrate import upgrade

    sqlite_url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('sealed-sqlite') / 'statestore.db'}"
    upgrade(sqlite_url)
    pg = StatestoreServer(
        database_url=sealed_pg_url,
        upstream_url=fake_backend_process.url,
        redis_url=redis_url,
        redis_prefix=sealed_prefix,
        env=_env(fake_backend_process),
    )
    try:
        lite = StatestoreServer(
            database_url=sqlite_url, upstream_url=fake_backend_process.url, env=_env(fake_backend_process)
        )
    except BaseException:
        pg.stop()
        raise
    yield {"postgres": (pg, sealed_pg_url), "sqlite": (lite, sqlite_url)}
    lite.stop()
    pg.stop()


@pytest.fixture(params=["postgres", "sqlite"])
def sealed(
    request: pytest.FixtureRequest, sealed_servers: dict[str, tuple[StatestoreServer, str]], backend: FakeBackend
) -> tuple[StatestoreServer, str]:
    return sealed_servers[request.param]


def _client(server: StatestoreServer, api_key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0)


async def _content_holding(url: str, marker: bytes) -> list[str]:
    """The table.column of every stored value holding `marker`; also how many values were looked at, to know the
    scan saw something."""
    engine = create_async_engine(url, poolclass=NullPool)
    found: list[str] = []
    seen = 0
    try:
        async with engine.connect() as conn:
            for table, columns in CONTENT_COLUMNS.items():
                for column in columns:
                    values = (await conn.execute(text(f"SELECT {column} FROM {table}"))).scalars().all()
                    seen += sum(1 for v in values if v)
                    found += [f"{table}.{column}" for v in values if v is not None and marker in bytes(v)]
    finally:
        await engine.dispose()
    assert seen > 0
    return found


def _redis_holding(redis_url: str, prefix: str, marker: bytes) -> tuple[list[str], int]:
    """The keys under `prefix` holding `marker` (streams read whole, the history cache's entries with the rest); and
    how many event streams were read."""
    client: Any = redis.Redis.from_url(redis_url)  # its replies' types are wide unions
    found: list[str] = []
    streams = 0
    try:
        for raw in client.scan_iter(match=f"{prefix}*", count=500):
            key = raw.decode()
            kind = client.type(raw).decode()
            values: list[bytes] = []
            if kind == "string":
                values = [client.get(raw) or b""]
            elif kind == "hash":
                values = [b"".join(k + v for k, v in client.hgetall(raw).items())]
            elif kind == "stream":
                streams += 1
                values = [b"".join(k + v for _, fields in client.xrange(raw) for k, v in fields.items())]
            elif kind == "list":
                values = list(client.lrange(raw, 0, -1))
            elif kind in ("set", "zset"):
                values = [repr(client.smembers(raw) if kind == "set" else client.zrange(raw, 0, -1)).encode()]
            if any(marker in value for value in values):
                found.append(key)
    finally:
        client.close()
    return found, streams


def _exercise(client: openai.OpenAI, backend: FakeBackend, marker: str) -> None:
    """Every kind of turn the door stores, each sending `marker`; the replies are checked as they come."""
    first = client.responses.create(model="echo-1", input=f"{marker} one", store=True)
    assert first.output_text == f"echo: {marker} one"
    second = client.responses.create(model="echo-1", input=f"{marker} two", previous_response_id=first.id)
    assert second.output_text == f"echo: {marker} two"
    with client.responses.stream(model="echo-1", input=f"{marker} three", previous_response_id=second.id) as stream:
        streamed = stream.get_final_response()
    assert streamed.output_text == f"echo: {marker} three"
    # A branch from the middle of the chain is rebuilt from the database (the cache holds the head's context).
    branch = client.responses.create(model="echo-1", input="branch", previous_response_id=first.id)
    assert branch.output_text == "echo: branch"
    sent = backend.requests()[-1].json()
    assert [m["content"] for m in sent["messages"]] == [f"{marker} one", f"echo: {marker} one", "branch"]
    assert client.responses.retrieve(second.id).output_text == f"echo: {marker} two"
    inputs = client.responses.input_items.list(second.id)
    assert inputs.data[0].model_dump()["content"][0]["text"] == f"{marker} two"
    client.responses.delete(branch.id)

    conversation = client.conversations.create(
        metadata={"topic": marker}, items=[{"type": "message", "role": "user", "content": f"{marker} hello"}]
    )
    assert client.conversations.retrieve(conversation.id).metadata == {"topic": marker}
    client.conversations.items.create(
        conversation.id, items=[{"type": "message", "role": "user", "content": f"{marker} appended"}]
    )
    turn = client.responses.create(model="echo-1", input=f"{marker} on it", conversation=conversation.id)
    assert turn.output_text == f"echo: {marker} on it"
    again = client.responses.create(model="echo-1", input="again", conversation=conversation.id)
    sent = backend.requests()[-1].json()
    assert [m["content"] for m in sent["messages"]][:2] == [f"{marker} hello", f"{marker} appended"]
    assert again.output_text == "echo: again"
    items = client.conversations.items.list(conversation.id, order="asc")
    texts = [item.model_dump()["content"][0]["text"] for item in items.data]
    assert texts[:4] == [f"{marker} hello", f"{marker} appended", f"{marker} on it", f"echo: {marker} on it"]
    one = client.conversations.items.retrieve(str(items.data[0].id), conversation_id=conversation.id)
    assert one.model_dump()["content"][0]["text"] == f"{marker} hello"
    # A response made on a conversation, continued as a chain: its items are read from the conversation.
    chained = client.responses.create(model="echo-1", input="chained", previous_response_id=turn.id)
    assert chained.output_text == "echo: chained"

    queued = client.responses.create(model="echo-1", input=f"{marker} background", background=True)
    done = final(client, queued.id)
    assert done.output_text == f"echo: {marker} background"
    key = client.api_key
    base = str(client.base_url).removesuffix("/v1/")
    replayed = list(raw_events(base, key, queued.id, None))
    assert replayed[-1]["type"] == "response.completed"
    assert f"echo: {marker} background" in str(replayed[-1])
    resumed = list(raw_events(base, key, queued.id, 1))
    assert resumed[0]["sequence_number"] == 2
    continued = client.responses.create(model="echo-1", input="after", previous_response_id=done.id)
    assert continued.output_text == "echo: after"

    # Compaction: a chain past its threshold summarises, and its head (the summary) is stored sealed.
    backend.watch_context(window=800, summary_marker=SUMMARY_MARKER)
    previous: str | None = None
    compacted = False
    for number in range(60):
        response: Any = client.responses.create(
            model="echo-1",
            input=f"{marker} turn {number}: tell me more",
            previous_response_id=previous,
            context_management=[{"type": "compaction", "compact_threshold": 600}],
        )
        previous = response.id
        assert response.output[-1].content[0].text == f"echo: {marker} turn {number}: tell me more"
        if response.output[0].type == "compaction":
            compacted = True
        elif compacted:
            break  # a turn after the compaction was rebuilt on its head
    assert compacted


async def test_nothing_in_clear_at_rest_and_replies_are_right(
    sealed: tuple[StatestoreServer, str], backend: FakeBackend, redis_url: str, sealed_prefix: str
) -> None:
    server, url = sealed
    marker = f"MARKER{secrets.token_hex(6)}"
    api_key = f"sk-sealed-{secrets.token_hex(8)}"
    with _client(server, api_key) as client:
        _exercise(client, backend, marker)
    assert await _content_holding(url, marker.encode()) == []
    assert await _content_holding(url, api_key.encode()) == []  # the background turn's credential is sealed too
    if url.startswith("postgresql"):
        found, streams = _redis_holding(redis_url, sealed_prefix, marker.encode())
        assert found == []
        assert streams >= 1  # the background turn's events were kept, and read


async def _copy(url: str, sql: str) -> None:
    engine = create_async_engine(url, poolclass=NullPool)
    try:
        async with engine.begin() as conn:
            await conn.execute(text(sql))
    finally:
        await engine.dispose()


async def test_an_item_moved_to_another_position_or_owner_does_not_open(
    sealed: tuple[StatestoreServer, str], backend: FakeBackend
) -> None:
    server, url = sealed
    marker = f"MARKER{secrets.token_hex(6)}"
    two: Any = [
        {"type": "message", "role": "user", "content": f"{marker} first"},
        {"type": "message", "role": "user", "content": f"{marker} second"},
    ]
    with _client(server, f"sk-a-{secrets.token_hex(8)}") as a, _client(server, f"sk-b-{secrets.token_hex(8)}") as b:
        mine = a.responses.create(model="echo-1", input=two)
        theirs = b.responses.create(model="echo-1", input=two)
        assert len(a.responses.input_items.list(mine.id).data) == 2
        # Position 0's sealed body over position 1's, in the same response.
        await _copy(
            url,
            f"UPDATE response_items SET body = (SELECT body FROM response_items WHERE response_id = '{mine.id}' "
            f"AND position = 0) WHERE response_id = '{mine.id}' AND position = 1",
        )
        with pytest.raises(openai.InternalServerError) as moved:
            a.responses.input_items.list(mine.id)
        assert marker not in str(moved.value.body) and marker not in moved.value.response.text
        # Owner a's sealed body into owner b's row, at the same position.
        await _copy(
            url,
            f"UPDATE response_items SET body = (SELECT body FROM response_items WHERE response_id = '{mine.id}' "
            f"AND position = 0) WHERE response_id = '{theirs.id}' AND position = 0",
        )
        with pytest.raises(openai.InternalServerError) as stolen:
            b.responses.input_items.list(theirs.id)
        assert marker not in stolen.value.response.text
        # A rendering moved the same way breaks the rebuild of a branch from it, never serving garbage.
        await _copy(
            url,
            f"UPDATE response_items SET rendered = (SELECT rendered FROM response_items WHERE response_id = "
            f"'{mine.id}' AND position = 1) WHERE response_id = '{mine.id}' AND position = 0",
        )
        a.responses.create(model="echo-1", input="cached head", previous_response_id=mine.id)  # from the cache
        with pytest.raises(openai.InternalServerError) as rebuilt:
            a.responses.create(model="echo-1", input="a branch", previous_response_id=mine.id)
        assert marker not in rebuilt.value.response.text
