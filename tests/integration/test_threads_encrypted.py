"""Message threads with encryption at rest (issue 24), through the official SDK against real server processes on
PostgreSQL + Redis and on SQLite + the in-process cache: the replies are right, while no content byte lies in clear in
the database or in Redis, and a stored value moved to another position or owner does not open."""

from __future__ import annotations

import asyncio
import secrets
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anthropic
import asyncpg
import pytest
import redis
from anthropic.types.beta import BetaToolParam

from statestore.content_keys import is_sealed
from statestore.sealing import new_key_text
from statestore.store.pg_hot_path import asyncpg_dsn
from statestore.store.sealed_cache import CONSOLIDATE_FRAMES, split_frames
from statestore.threads.ids import thread_of_response
from tests.integration.test_threads import MODEL, echo, forwarded, said, user
from tests.support.admin_api import Api, json_of
from tests.support.fake_backend import FakeBackend
from tests.support.server import StatestoreServer

KEYS = {"STATESTORE_ENCRYPTION_KEYS": f"k1:{new_key_text()}"}
TURNS = 20  # past the point where a sealed cache entry of one frame per turn is written back as one


@dataclass(frozen=True)
class Sealed:
    server: StatestoreServer
    database_url: str
    redis_url: str | None = None
    prefix: str = ""

    @property
    def url(self) -> str:
        return self.server.url


@pytest.fixture(scope="module")
def encrypted_pg_server(
    module_db: str, redis_url: str, module_prefix: str, fake_backend_process: FakeBackend
) -> Iterator[Sealed]:
    server = StatestoreServer(
        database_url=module_db,
        upstream_url=fake_backend_process.url,
        redis_url=redis_url,
        redis_prefix=module_prefix,
        env=KEYS,
    )
    yield Sealed(server, module_db, redis_url, module_prefix)
    server.stop()


@pytest.fixture(scope="module")
def encrypted_sqlite_server(
    tmp_path_factory: pytest.TempPathFactory, fake_backend_process: FakeBackend
) -> Iterator[Sealed]:
    from statestore.store.migrate import upgrade

    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('sealed') / 'statestore.db'}"
    upgrade(url)
    server = StatestoreServer(database_url=url, upstream_url=fake_backend_process.url, env=KEYS)
    yield Sealed(server, url)
    server.stop()


@pytest.fixture(params=["pg", "sqlite"])
def sealed(request: pytest.FixtureRequest) -> Sealed:
    value: Sealed = request.getfixturevalue(f"encrypted_{request.param}_server")
    return value


def _sql(sealed: Sealed, statement: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """A statement (`$1`… placeholders) on the server's own database, as an operator with a dump would run it."""
    url = sealed.database_url
    if url.startswith("sqlite"):
        for index in range(len(params), 0, -1):
            statement = statement.replace(f"${index}", "?")
        with sqlite3.connect(url.split("///", 1)[1]) as conn:
            return conn.execute(statement, params).fetchall()

    async def run() -> list[tuple[Any, ...]]:
        conn = await asyncpg.connect(asyncpg_dsn(url))
        try:
            return [tuple(row) for row in await conn.fetch(statement, *params)]
        finally:
            await conn.close()

    return asyncio.run(run())


def _redis_values(sealed: Sealed) -> list[bytes]:
    if sealed.redis_url is None:
        return []
    client = redis.Redis.from_url(sealed.redis_url)
    values: list[bytes] = []
    for key in client.scan_iter(match=sealed.prefix + "*"):
        kind = client.type(key)
        if kind == b"string":
            values.append(key + b"=" + (client.get(key) or b""))
        elif kind == b"hash":
            values.extend(key + b"=" + k + v for k, v in client.hgetall(key).items())
        else:
            values.append(key)
    return values


def _assert_nowhere(server: Sealed, marker: str) -> None:
    needle = marker.encode()
    for table, column in (
        ("thread_messages", "body"),
        ("threads", "system"),
        ("threads", "tools"),
        ("threads", "context_head"),
    ):
        for (value,) in _sql(server, f"SELECT {column} FROM {table} WHERE {column} IS NOT NULL"):
            assert needle not in bytes(value), f"{table}.{column} holds content in clear"
            assert is_sealed(bytes(value)), f"{table}.{column} holds a value that is not sealed"
    values = _redis_values(server)
    for value in values:
        assert needle not in value, "a Redis value holds content in clear"
    if server.redis_url is not None:
        assert any(value.endswith(b":n=3:%d" % (2 * TURNS)) for value in values), "the thread's entry is sealed"


def test_threads_round_trip_sealed(sealed: Sealed, api_key: str, backend: FakeBackend) -> None:
    marker = f"MARKER{secrets.token_hex(8)}"
    system = f"You answer briefly. {marker}"
    tool: BetaToolParam = {
        "name": "lookup",
        "description": f"Looks things up {marker}",
        "input_schema": {"type": "object", "properties": {}},
    }
    with anthropic.Anthropic(base_url=sealed.url, api_key=api_key, max_retries=0) as sdk:
        thread = sdk.beta.messages.thread(
            model=MODEL, max_tokens=256, system=system, tools=[tool], metadata={"user_id": "sealed-user"}
        )
        expected: list[Any] = []
        for turn in range(TURNS):
            text = f"turn {turn} {marker}"
            reply: Any
            if turn == 3:
                with thread.stream(user(text)) as stream:
                    reply = stream.get_final_message()
            else:
                reply = thread.send(user(text))
            assert reply.to_dict()["content"] == echo(text)
            body = forwarded(backend)
            expected += [user(text)]
            assert body["messages"] == expected, f"turn {turn}: the rebuilt history"
            assert body["system"] == system and body["tools"] == [tool]
            expected.append(said(reply))
        thread_id = thread_of_response(reply.id)
        assert thread_id is not None
    with Api(sealed.url, api_key) as api:
        first = api.session(f"s-{marker[-6:]}", f"session one {marker}")
        assert first.status_code == 200
        second = api.session(f"s-{marker[-6:]}", f"session two {marker}")
        assert json_of(second)["content"] == echo(f"session two {marker}")
        assert [m["content"] for m in forwarded(backend)["messages"]][-1] == f"session two {marker}"
        for listed in json_of(api.threads(limit=10))["data"]:
            exported = json_of(api.export(listed["id"]))
            assert marker in str(exported), "export is in clear for its owner"
        exported = json_of(api.export(thread_id))
        assert exported["messages"] == expected
    _assert_nowhere(sealed, marker)
    if sealed.redis_url is not None:
        entry = redis.Redis.from_url(sealed.redis_url).get(f"{sealed.prefix}{{{thread_id}}}:h")
        assert isinstance(entry, bytes)
        frames = split_frames(entry)
        # One frame per turn until a read met more than CONSOLIDATE_FRAMES; then the commit wrote it back as one.
        assert frames is not None and 1 <= len(frames) <= CONSOLIDATE_FRAMES + 1


def test_a_sealed_row_moved_to_another_position_or_owner_does_not_open(sealed: Sealed, backend: FakeBackend) -> None:
    marker = f"MARKER{secrets.token_hex(8)}"
    with (
        Api(sealed.url, f"sk-test-{secrets.token_hex(8)}") as api,
        Api(sealed.url, f"sk-test-{secrets.token_hex(8)}") as other,
    ):
        mine = json_of(api.create(f"mine {marker}"))
        mine_id = api.thread_ids()[0]
        json_of(api.continue_(mine["id"], f"second {marker}"))
        theirs_id = (json_of(other.create(f"theirs {marker}")), other.thread_ids()[0])[1]
        # Position 2 takes position 0's value (same thread, same key): the associated data names the position.
        _sql(
            sealed,
            "UPDATE thread_messages SET body = (SELECT body FROM thread_messages WHERE thread_id = $1 AND position = 0)"
            " WHERE thread_id = $2 AND position = 2",
            (mine_id, mine_id),
        )
        refused = api.export(mine_id)
        assert refused.status_code == 500
        assert marker not in refused.text
        # Another owner's thread takes my first message at its own position 0.
        _sql(
            sealed,
            "UPDATE thread_messages SET body = (SELECT body FROM thread_messages WHERE thread_id = $1 AND position = 0)"
            " WHERE thread_id = $2 AND position = 0",
            (mine_id, theirs_id),
        )
        refused = other.export(theirs_id)
        assert refused.status_code == 500
        assert marker not in refused.text
        log = sealed.server.log()
        assert theirs_id in log and mine_id in log
        assert marker not in log
