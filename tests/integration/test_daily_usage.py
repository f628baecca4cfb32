"""Turns and bytes per day (the console's charts, GET /admin/v1/usage, `statestore admin usage`): counted as each turn
commits, through both front doors and by door, on PostgreSQL's one-statement commits and on SQLite's transactions
alike; a lost lease counts nothing."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import create_async_engine

from statestore.store.schema import conversation_items, daily_usage, response_items, responses, threads
from statestore.store.usage_rows import USAGE_SHARDS
from tests.support.admin_api import (
    ADMIN_TOKENS,
    AdminApi,
    Api,
    cli,
    cli_env,
    cli_json,
    cli_ok,
    created,
    run_async,
    start_server,
)
from tests.support.fake_backend import FakeBackend
from tests.support.redis_keys import own_redis_prefix
from tests.support.server import StatestoreServer


@pytest.fixture(scope="module", params=["postgres", "sqlite"])
def usage_server(
    request: pytest.FixtureRequest,
    module_db: str,
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
    fake_backend_process: FakeBackend,
) -> Iterator[tuple[StatestoreServer, str]]:
    env = {"STATESTORE_ADMIN_TOKENS": ADMIN_TOKENS, "STATESTORE_CHAT_UPSTREAM_URL": fake_backend_process.url}
    if request.param == "postgres":
        with own_redis_prefix(redis_url) as prefix:
            server = start_server(module_db, fake_backend_process.url, redis_url, prefix, env)
            yield server, module_db
            server.stop()
        return
    from statestore.store.migrate import upgrade

    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('usage') / 'statestore.db'}"
    upgrade(url)
    server = StatestoreServer(database_url=url, upstream_url=fake_backend_process.url, env=env)
    yield server, url
    server.stop()


def _today(admin: AdminApi) -> dict[str, Any]:
    days = admin.ok("GET", "/usage", days=3)["data"]
    assert [d["day"] for d in days] == sorted(d["day"] for d in days) and len(days) == 3
    today: dict[str, Any] = days[-1]
    assert today["day"] == datetime.now(UTC).strftime("%Y-%m-%d")
    return today


_TURN_SAMPLE = re.compile(r'^turns_total\{door="(\w+)",kind="(\w+)",outcome="(\w+)"\} (\S+)$', re.M)


def _turn_metrics(server: StatestoreServer) -> dict[tuple[str, ...], float]:
    """(door, kind, outcome) → turns counted, from the server's /metrics."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {(door, kind, outcome): float(value) for door, kind, outcome, value in _TURN_SAMPLE.findall(text)}


async def _stored_bytes(database_url: str, thread_ids: list[str]) -> int:
    engine = create_async_engine(database_url)
    try:
        async with engine.connect() as conn:
            total = await conn.scalar(
                select(func.coalesce(func.sum(threads.c.byte_count), 0)).where(threads.c.id.in_(thread_ids))
            )
            rows = await conn.scalar(select(func.count()).select_from(daily_usage))
    finally:
        await engine.dispose()
    assert rows is not None and rows >= 1
    return int(total or 0)


def test_each_committed_turn_adds_to_todays_turns_and_bytes(
    usage_server: tuple[StatestoreServer, str], api_key: str, backend: FakeBackend
) -> None:
    server, database_url = usage_server
    with AdminApi(server.url) as admin, Api(server.url, api_key) as api:
        before = _today(admin)
        thread_ids = []
        for index in range(3):
            thread_id, head = created(api.create(f"first turn {index}"))
            created(api.continue_(head, "second turn"))
            thread_ids.append(thread_id)
        # A stateless request stores nothing and counts nothing.
        assert api.stateless("not stored").status_code == 200
        after = _today(admin)
    assert after["turns"] - before["turns"] == 6
    assert after["bytes"] - before["bytes"] == run_async(lambda: _stored_bytes(database_url, thread_ids))

    # The CLI reads the same counters through the same service.
    shown = cli_json(cli(cli_env(database_url), "admin", "usage", "--days", "1", "--json"))
    assert shown["data"][-1]["turns"] >= after["turns"]


def test_usage_needs_an_admin_token_and_a_sane_range(usage_server: tuple[StatestoreServer, str]) -> None:
    server, database_url = usage_server
    with AdminApi(server.url, "not-an-admin-token-at-all") as stranger:
        assert stranger.call("GET", "/usage").status_code == 401
    with AdminApi(server.url) as admin:
        assert admin.call("GET", "/usage", days=0).status_code == 400
        assert admin.call("GET", "/usage", days=367).status_code == 400
        assert admin.call("GET", "/usage", days="a week").status_code == 400
    env = cli_env(database_url)
    for days in ("0", "367"):
        refused = cli(env, "admin", "usage", "--days", days)
        assert refused.returncode != 0 and refused.stderr.strip() == "statestore: days must be between 1 and 366"


async def _responses_bytes(database_url: str, response_ids: list[str], conversation_id: str) -> int:
    """What the Responses turns stored: their bodies and their items' (Responses JSON and rendering), wherever the
    items are (a chain's own, a conversation's)."""
    engine = create_async_engine(database_url)
    try:
        async with engine.connect() as conn:
            body_bytes = func.coalesce(func.sum(func.length(responses.c.body)), 0)
            bodies = await conn.scalar(select(body_bytes).where(responses.c.id.in_(response_ids)))
            items = 0
            for table, mine in (
                (response_items, response_items.c.response_id.in_(response_ids)),
                (conversation_items, conversation_items.c.conversation_id == conversation_id),
            ):
                items += int(
                    await conn.scalar(
                        select(func.coalesce(func.sum(func.length(table.c.body) + func.length(table.c.rendered)), 0))
                        .select_from(table)
                        .where(mine)
                    )
                    or 0
                )
            shards = {
                door: (low, high)
                for door, low, high in await conn.execute(
                    select(daily_usage.c.door, func.min(daily_usage.c.shard), func.max(daily_usage.c.shard)).group_by(
                        daily_usage.c.door
                    )
                )
            }
    finally:
        await engine.dispose()
    # Each door on shards of its own, so the key stays (day, shard) for code from before the door column.
    assert shards.keys() == {"messages", "responses"}
    assert 0 <= shards["messages"][0] <= shards["messages"][1] < USAGE_SHARDS
    assert USAGE_SHARDS <= shards["responses"][0] <= shards["responses"][1] < 2 * USAGE_SHARDS
    return int(bodies or 0) + items


def test_both_doors_are_counted_by_door(
    usage_server: tuple[StatestoreServer, str], api_key: str, backend: FakeBackend
) -> None:
    """7 thread turns and 5 Responses turns (a chain of 3, 2 on a conversation) are 12 turns that day: 7 through the
    Messages door, 5 through the Responses door, each door's bytes what its turns stored."""
    server, database_url = usage_server
    with AdminApi(server.url) as admin, Api(server.url, api_key) as api:
        before, counted_before = _today(admin), _turn_metrics(server)
        thread_ids = []
        for index in range(2):
            thread_id, head = created(api.create(f"thread {index}"))
            for turn in range(2 if index == 0 else 3):
                _, head = created(api.continue_(head, f"turn {turn}"))
            thread_ids.append(thread_id)
        with openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0) as sdk:
            first = sdk.responses.create(model="echo-1", input="a chain")
            second = sdk.responses.create(model="echo-1", input="goes on", previous_response_id=first.id)
            third = sdk.responses.create(model="echo-1", input="and on", previous_response_id=second.id)
            conversation = sdk.conversations.create()
            on_conversation = [
                sdk.responses.create(model="echo-1", input=text, conversation=conversation.id).id
                for text in ("in a conversation", "still in it")
            ]
            # store: false stores nothing, so counts nothing, as a request without a thread.
            sdk.responses.create(model="echo-1", input="not stored", store=False)
            with pytest.raises(openai.BadRequestError):
                sdk.responses.create(model="echo-1", input="x", previous_response_id="resp_" + "0" * 32)
        after, counted_after = _today(admin), _turn_metrics(server)

    def added(door: str, what: str) -> int:
        return int(after["doors"][door][what] - before["doors"][door][what])

    assert (added("messages", "turns"), added("responses", "turns")) == (7, 5)
    assert after["turns"] - before["turns"] == 12
    assert after["turns"] == after["doors"]["messages"]["turns"] + after["doors"]["responses"]["turns"]
    assert after["bytes"] == after["doors"]["messages"]["bytes"] + after["doors"]["responses"]["bytes"]
    assert added("messages", "bytes") == run_async(lambda: _stored_bytes(database_url, thread_ids))
    response_ids = [first.id, second.id, third.id, *on_conversation]
    assert added("responses", "bytes") == run_async(
        lambda: _responses_bytes(database_url, response_ids, conversation.id)
    )

    # /metrics counts the same turns by door and kind, and the refused one.
    moved = {labels: counted_after[labels] - counted_before.get(labels, 0) for labels in counted_after}
    assert {labels: count for labels, count in moved.items() if count} == {
        ("messages", "create", "stored"): 2,
        ("messages", "continue", "stored"): 5,
        ("responses", "create", "stored"): 1,
        ("responses", "continue", "stored"): 2,
        ("responses", "conversation", "stored"): 2,
        ("responses", "continue", "rejected"): 1,
    }

    # The CLI shows the same counts, by door, as text and as JSON.
    env = cli_env(database_url)
    shown = cli_json(cli(env, "admin", "usage", "--days", "1", "--json"))["data"][-1]
    assert shown["doors"]["responses"]["turns"] >= after["doors"]["responses"]["turns"]
    header, today, *_ = cli_ok(cli(env, "admin", "usage", "--days", "1")).splitlines()
    columns = re.split(r"  +", header.strip())
    by_door = ["MESSAGES TURNS", "MESSAGES BYTES", "RESPONSES TURNS", "RESPONSES BYTES"]
    assert columns == ["DAY", "TURNS", "BYTES", *by_door]
    values = dict(zip(columns, today.split(), strict=True))
    assert int(values["MESSAGES TURNS"]) + int(values["RESPONSES TURNS"]) == int(values["TURNS"])
    assert int(values["RESPONSES TURNS"]) >= after["doors"]["responses"]["turns"]
