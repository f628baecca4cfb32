"""The background purger (statestore/retention.py run_purger) keeps its schedule through any failure: an error that
is no database error is logged, by type and without its message (which may quote content), and the next interval
purges as usual. Both storage set-ups: PostgreSQL + Redis and SQLite + the in-process cache."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from statestore.retention import Retention, run_purger
from statestore.store.admin_repository import AdminRepository
from statestore.store.cache_setup import create_cache
from statestore.store.engine import create_engine
from statestore.store.resp_cluster import redis_client
from statestore.store.retention_queries import RetentionQueries
from tests.conftest import migrated_scratch_pg_database

SECRET = "the user's words that must never reach a log"


class _FailingOnce(RetentionQueries):
    """The real queries, but the first purge meets a failure of the code (not of the database)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0

    async def purge_expired(self, *, now_ms: int, batch_size: int) -> list[str]:
        self.calls += 1
        if self.calls == 1:
            raise ValueError(SECRET)
        return await super().purge_expired(now_ms=now_ms, batch_size=batch_size)


@pytest.fixture(params=["postgres+redis", "sqlite+memory"])
async def stores(
    request: pytest.FixtureRequest, migrated_sqlite_url: str, postgres_admin_url: str, redis_url: str
) -> AsyncIterator[tuple[str, str | None]]:
    if request.param == "sqlite+memory":
        yield migrated_sqlite_url, None
        return
    async with migrated_scratch_pg_database(postgres_admin_url) as url:
        yield url, redis_url


async def test_purger_survives_an_error_that_is_no_database_error(
    stores: tuple[str, str | None], caplog: pytest.LogCaptureFixture
) -> None:
    database_url, redis_url = stores
    engine = create_engine(database_url, pool_size=1)
    redis = redis_client(redis_url) if redis_url else None
    cache = create_cache(redis, "sstest:purger:")
    queries = _FailingOnce(engine)
    admin = AdminRepository(engine)
    now_ms = 1_700_000_000_000
    retention = Retention(queries=queries, admin=admin, cache=cache, clock=lambda: now_ms, batch_size=10)
    caplog.set_level(logging.WARNING, logger="statestore.retention")
    purger = asyncio.create_task(run_purger(retention, 0.05))
    try:
        async with asyncio.timeout(10):
            while queries.calls < 3 and not purger.done():
                await asyncio.sleep(0.02)
        assert not purger.done(), "the purger ended on the first failure"
        # The runs after the failure completed: the last run is recorded.
        assert (await admin.stats(now_ms=now_ms))["purger_last_run_ms"] == now_ms
    finally:
        purger.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await purger
        await cache.aclose()
        if redis is not None:
            await redis.aclose()
        await engine.dispose()
    failures = [r for r in caplog.records if r.name == "statestore.retention" and r.levelno >= logging.ERROR]
    assert len(failures) == 1
    assert getattr(failures[0], "error", None) == "ValueError"
    for record in caplog.records:
        assert SECRET not in record.getMessage()
        assert record.exc_info is None and record.exc_text is None
        assert all(SECRET not in str(value) for value in record.__dict__.values())
