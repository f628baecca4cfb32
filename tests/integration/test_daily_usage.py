"""Turns and bytes per day (the console's charts, GET /admin/v1/usage, `statestore admin usage`): counted as each turn
commits, on PostgreSQL's one-statement commit and on SQLite's transaction alike; a lost lease counts nothing."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import create_async_engine

from statestore.store.schema import daily_usage, threads
from tests.support.admin_api import (
    ADMIN_TOKENS,
    AdminApi,
    Api,
    cli,
    cli_env,
    cli_json,
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
    if request.param == "postgres":
        with own_redis_prefix(redis_url) as prefix:
            server = start_server(
                module_db, fake_backend_process.url, redis_url, prefix, {"STATESTORE_ADMIN_TOKENS": ADMIN_TOKENS}
            )
            yield server, module_db
            server.stop()
        return
    from statestore.store.migrate import upgrade

    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('usage') / 'statestore.db'}"
    upgrade(url)
    server = StatestoreServer(
        database_url=url, upstream_url=fake_backend_process.url, env={"STATESTORE_ADMIN_TOKENS": ADMIN_TOKENS}
    )
    yield server, url
    server.stop()


def _today(admin: AdminApi) -> dict[str, Any]:
    days = admin.ok("GET", "/usage", days=3)["data"]
    assert [d["day"] for d in days] == sorted(d["day"] for d in days) and len(days) == 3
    today: dict[str, Any] = days[-1]
    assert today["day"] == datetime.now(UTC).strftime("%Y-%m-%d")
    return today


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
    server, _ = usage_server
    with AdminApi(server.url, "not-an-admin-token-at-all") as stranger:
        assert stranger.call("GET", "/usage").status_code == 401
    with AdminApi(server.url) as admin:
        assert admin.call("GET", "/usage", days=0).status_code == 400
        assert admin.call("GET", "/usage", days=367).status_code == 400
