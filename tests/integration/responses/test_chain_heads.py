"""A chain's head served from Redis (store/response_heads.py): a continue by previous_response_id whose chain Redis
holds reads the previous response's row from beside the chain's context instead of the database; a row is served
only with that context, to its owner, and the database still refuses a turn whose parent is gone."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import asyncpg
import httpx
import openai
import orjson
import pytest
import redis

from statestore.store.pg_hot_path import asyncpg_dsn
from statestore.store.response_runs import decode
from tests.integration.responses.conftest import Rows, last_chat_request, other_key
from tests.support.fake_backend import FakeBackend
from tests.support.server import StatestoreServer


def _parents(server: StatestoreServer) -> dict[str, float]:
    """response_parents_total by where the row was read, from the server's /metrics."""
    text = httpx.get(f"{server.url}/metrics").text
    found = re.findall(r'^response_parents_total\{read="(\w+)"\} ([0-9.e+]+)$', text, re.M)
    return {read: float(value) for read, value in found}


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {read: after[read] - before.get(read, 0.0) for read in after}


def _database(url: str, query: str, *args: object) -> object:
    async def run() -> object:
        conn = await asyncpg.connect(asyncpg_dsn(url))
        try:
            return await conn.fetchval(query, *args)
        finally:
            await conn.close()

    return asyncio.run(run())


@pytest.fixture
def kv(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def _key(prefix: str, response_id: str, suffix: str) -> str:
    return f"{prefix}{{resp:{response_id}}}:{suffix}"


def _chain(client: openai.OpenAI, turns: int) -> list[str]:
    ids: list[str] = []
    for turn in range(turns):
        previous = ids[-1] if ids else None
        ids.append(client.responses.create(model="echo-1", input=f"turn {turn}", previous_response_id=previous).id)
    return ids


def test_a_continue_reads_its_parent_beside_the_cached_context(
    openai_client: openai.OpenAI,
    responses_server: StatestoreServer,
    responses_pg_url: str,
    backend: FakeBackend,
    kv: redis.Redis,
    responses_redis_prefix: str,
) -> None:
    before = _parents(responses_server)
    ids = _chain(openai_client, 5)
    assert _delta(before, _parents(responses_server)) == {"cache": 4, "database": 0}
    # one row per cached head: each move took its parent's row away
    assert kv.exists(_key(responses_redis_prefix, ids[-1], "r"))
    assert not any(kv.exists(_key(responses_redis_prefix, i, "r")) for i in ids[:-1])
    # the rows the database stored from rows Redis served: the depth, and the items in one run (the runs the commit
    # returned were served to the next turn)
    assert _database(responses_pg_url, "SELECT depth FROM responses WHERE id = $1", ids[-1]) == 4
    runs = _database(responses_pg_url, "SELECT context_runs FROM responses WHERE id = $1", ids[-1])
    assert isinstance(runs, bytes) and len(decode(runs).runs) == 1 and decode(runs).items == 10
    # and the context sent is the chain's
    backend.reset()
    openai_client.responses.create(model="echo-1", input="next", previous_response_id=ids[-1])
    sent = orjson.loads(last_chat_request(backend).body)["messages"]
    assert [m["content"] for m in sent] == [
        *[text for turn in range(5) for text in (f"turn {turn}", f"echo: turn {turn}")],
        "next",
    ]


def test_a_row_without_its_context_is_not_served(
    openai_client: openai.OpenAI,
    responses_server: StatestoreServer,
    backend: FakeBackend,
    kv: redis.Redis,
    responses_redis_prefix: str,
) -> None:
    """What a release that keeps no rows does to an entry (moves or drops the context, leaves the row) is a miss."""
    ids = _chain(openai_client, 2)
    assert kv.exists(_key(responses_redis_prefix, ids[-1], "r"))
    kv.delete(_key(responses_redis_prefix, ids[-1], "h"))
    before = _parents(responses_server)
    backend.reset()
    openai_client.responses.create(model="echo-1", input="again", previous_response_id=ids[-1])
    assert _delta(before, _parents(responses_server)) == {"cache": 0, "database": 1}
    sent = orjson.loads(last_chat_request(backend).body)["messages"]
    assert [m["content"] for m in sent][-1] == "again" and len(sent) == 5


def test_a_row_is_served_to_its_owner_only(
    openai_client: openai.OpenAI, responses_server: StatestoreServer, api_key: str
) -> None:
    ids = _chain(openai_client, 2)
    stranger = openai.OpenAI(base_url=responses_server.url + "/v1", api_key=other_key(), max_retries=0)
    with stranger, pytest.raises(openai.BadRequestError):
        stranger.responses.create(model="echo-1", input="mine?", previous_response_id=ids[-1])


async def test_a_parent_deleted_behind_the_cache_is_not_continued(
    openai_client: openai.OpenAI, responses_pg_url: str, rows: Rows, api_key: str
) -> None:
    """A deletion whose cache drop failed (Redis away at that moment) leaves the row and context in Redis: the continue
    is served them, and the commit, which finds the parent gone, stores nothing and answers that the previous response
    is not found."""
    ids = await asyncio.to_thread(_chain, openai_client, 2)
    stored = await rows.counts(api_key)
    conn = await asyncpg.connect(asyncpg_dsn(responses_pg_url))
    try:
        await conn.execute("DELETE FROM response_items WHERE response_id = $1", ids[-1])
        await conn.execute("DELETE FROM responses WHERE id = $1", ids[-1])
    finally:
        await conn.close()
    with pytest.raises(openai.BadRequestError) as refused:
        await asyncio.to_thread(
            openai_client.responses.create, model="echo-1", input="after", previous_response_id=ids[-1]
        )
    assert ids[-1] in str(refused.value)
    after = await rows.counts(api_key)
    assert after["responses"] == stored["responses"] - 1


def test_a_branch_keeps_its_parents_row_for_the_next_branch(
    openai_client: openai.OpenAI,
    responses_server: StatestoreServer,
    backend: FakeBackend,
    kv: redis.Redis,
    responses_redis_prefix: str,
) -> None:
    """The first branch from a response reads it from the database and keeps its context as a branch point, with its
    row: the next branch from it (a regenerate) reads neither from the database."""
    ids = _chain(openai_client, 4)
    before = _parents(responses_server)
    openai_client.responses.create(model="echo-1", input="first branch", previous_response_id=ids[1])
    assert _delta(before, _parents(responses_server)) == {"cache": 0, "database": 1}
    assert kv.exists(_key(responses_redis_prefix, ids[1], "r"))
    backend.reset()
    openai_client.responses.create(model="echo-1", input="second branch", previous_response_id=ids[1])
    assert _delta(before, _parents(responses_server)) == {"cache": 1, "database": 1}
    sent = orjson.loads(last_chat_request(backend).body)["messages"]
    assert [m["content"] for m in sent] == ["turn 0", "echo: turn 0", "turn 1", "echo: turn 1", "second branch"]
