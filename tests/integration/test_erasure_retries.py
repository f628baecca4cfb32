"""An erasure that stops on an error is run again by the servers' sweep, a lease after it failed and twice as long
after each further failure, until it is done or has failed MAX_ATTEMPTS times: then it stays `failed`, logged at
error level. Before, a transient database error left a user's data undeleted, `failed`, until a person sent the
erasure again.

On the database itself (PostgreSQL and SQLite), with the erasure's clock moved by the test, and the database errors
injected into the erasure's deletions: a retry is found and claimed through the row alone (attempts, retry time), as
another replica, or this one restarted, would."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from sqlalchemy import func, insert, select
from sqlalchemy.exc import OperationalError

from statestore.admin import erasure_fields
from statestore.config import Settings
from statestore.erasure_runs import MAX_ATTEMPTS, ErasureRuns
from statestore.resources import Resources, build_resources
from statestore.store.erasure_log import ErasureLog, ErasureState
from statestore.store.retention_queries import Erasure
from statestore.store.schema import erasures, threads
from statestore.threads.ids import new_thread_id
from tests.support.admin_api import cli, cli_env, cli_json, cli_ok, unique
from tests.support.server import OWNER_SECRET

LEASE_SECONDS = 2  # the first retry 2 s after the failure, then 4, 8, 16, 32 s (by the test's clock)
START_MS = 1_900_000_000_000


@pytest.fixture
async def built(scratch_database_url: str) -> AsyncIterator[Resources]:
    # Two threads a batch: the first batch is deleted before the injected error.
    settings = Settings(database_url=scratch_database_url, owner_secret=OWNER_SECRET, purge_batch_size=2)
    async with build_resources(settings, serving=False) as resources:
        yield resources


def failing(deletion: Callable[..., Awaitable[list[str]]], fails: Callable[[int], bool]) -> Callable[..., Any]:
    """The erasure's thread deletion, raising what a dropped database connection raises on the calls `fails` picks
    (counted from 1)."""
    calls = [0]

    async def deleting(**kwargs: Any) -> list[str]:
        calls[0] += 1
        if fails(calls[0]):
            raise OperationalError("DELETE FROM threads", None, ConnectionResetError("connection lost"))
        return await deletion(**kwargs)

    return deleting


async def user_threads(built: Resources, user_id: str, count: int = 0) -> int:
    """Store `count` threads of the user; how many the user has."""
    async with built.engine.begin() as conn:
        for _ in range(count):
            await conn.execute(
                insert(threads).values(
                    id=new_thread_id(),
                    owner="owner",
                    metadata_user_id=user_id,
                    ttl_seconds=3600,
                    created_ms=START_MS,
                    updated_ms=START_MS,
                    expires_ms=START_MS + 3_600_000,
                )
            )
        query = select(func.count()).select_from(threads).where(threads.c.metadata_user_id == user_id)
        return int((await conn.execute(query)).scalar_one())


async def finish_runs(runs: ErasureRuns) -> None:
    await asyncio.gather(*runs._running.values())


async def test_an_erasure_failing_on_a_transient_error_is_done_by_itself(
    built: Resources, scratch_database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [START_MS]
    records = ErasureLog(built.engine)
    first, later = (
        ErasureRuns(records, built.retention, clock=lambda: now[0], lease_seconds=LEASE_SECONDS) for _ in range(2)
    )
    user_id = unique("user")
    assert await user_threads(built, user_id, 3) == 3
    # The connection drops once, after the first batch of two threads is deleted.
    monkeypatch.setattr(
        built.retention.queries, "erase_batch", failing(built.retention.queries.erase_batch, lambda n: n == 2)
    )
    state = ErasureState(
        id=f"erasure_{unique('flaky')}",
        actor="ops",
        tenant_id=None,
        user_id=user_id,
        status="running",
        created_ms=now[0],
    )
    await first.begin(state)
    with pytest.raises(OperationalError):
        await first.run(state)

    failed = await records.get(state.id)
    assert failed is not None and (failed.status, failed.attempts) == ("failed", 1)
    assert failed.retry_at_ms == now[0] + LEASE_SECONDS * 1000
    assert await user_threads(built, user_id) == 1
    # The admin API's fields and `statestore admin erasure ID` say it is failed and will be retried, and when.
    fields = erasure_fields(failed)
    assert (fields["status"], fields["attempts"], fields["retry_at"]) == ("failed", 1, "2030-03-17T17:46:42.000Z")
    env = cli_env(scratch_database_url, owner_secret=OWNER_SECRET)
    assert cli_json(cli(env, "admin", "erasure", state.id, "--json")) == fields
    assert cli_ok(cli(env, "admin", "erasure", state.id)) == (
        f"{state.id}: failed after 1 attempt, to be retried from 2030-03-17T17:46:42.000Z (by any server)\n"
    )

    # Not before its retry is due: its failure stays recorded.
    now[0] += LEASE_SECONDS * 1000 - 1
    assert await later.take_up() == 0
    assert (await records.get(state.id)) == failed
    # Due: another replica (or this one restarted) claims it from the row alone and runs it to its end.
    now[0] += 1
    assert await later.take_up() == 1
    await finish_runs(later)
    done = await records.get(state.id)
    assert done is not None and (done.status, done.attempts, done.retry_at_ms) == ("done", 2, None)
    assert done.erased == Erasure(threads=3, responses=0, conversations=0)  # both runs' threads
    assert await user_threads(built, user_id) == 0
    now[0] += 3_600_000
    assert await later.take_up() == 0  # done: never run again
    await first.aclose()
    await later.aclose()


async def test_an_erasure_that_keeps_failing_stops_after_its_last_attempt(
    built: Resources, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    now = [START_MS]
    records = ErasureLog(built.engine)
    runs = ErasureRuns(records, built.retention, clock=lambda: now[0], lease_seconds=LEASE_SECONDS)
    user_id = unique("user")
    monkeypatch.setattr(
        built.retention.queries, "erase_batch", failing(built.retention.queries.erase_batch, lambda _: True)
    )
    state = ErasureState(
        id=f"erasure_{unique('broken')}",
        actor="ops",
        tenant_id=None,
        user_id=user_id,
        status="running",
        created_ms=now[0],
    )
    await runs.begin(state)
    caplog.set_level(logging.INFO, logger="statestore.erasure_runs")
    with pytest.raises(OperationalError):
        await runs.run(state)

    waits = []
    for attempt in range(2, MAX_ATTEMPTS + 1):
        failed = await records.get(state.id)
        assert failed is not None and failed.retry_at_ms is not None
        assert (failed.status, failed.attempts) == ("failed", attempt - 1)
        waits.append(failed.retry_at_ms - now[0])
        now[0] = failed.retry_at_ms - 1
        assert await runs.take_up() == 0, f"attempt {attempt} ran before its delay"
        now[0] += 1
        assert await runs.take_up() == 1
        await finish_runs(runs)
    # The delay doubles from a lease.
    assert waits == [LEASE_SECONDS * 1000 * 2**n for n in range(MAX_ATTEMPTS - 1)]

    last = await records.get(state.id)
    assert last is not None and (last.status, last.attempts, last.retry_at_ms) == ("failed", MAX_ATTEMPTS, None)
    now[0] += 30 * 86_400_000
    assert await runs.take_up() == 0  # failed for good: left to a person
    assert erasure_fields(last)["retry_at"] is None and erasure_fields(last)["attempts"] == MAX_ATTEMPTS
    given_up = [r for r in caplog.records if r.getMessage() == "erasure failed for good"]
    assert len(given_up) == 1 and given_up[0].levelno == logging.ERROR
    assert (given_up[0].erasure, given_up[0].error) == (state.id, "OperationalError")  # type: ignore[attr-defined]
    retried = [r for r in caplog.records if r.getMessage() == "erasure retried"]
    assert len(retried) == MAX_ATTEMPTS - 1
    # Ids and error types only: never the user id the erasure names, nor the error's text.
    for record in caplog.records:
        assert user_id not in str(record.__dict__) and "connection lost" not in str(record.__dict__)
    await runs.aclose()


async def test_the_sweep_reads_only_running_and_failed_erasures_through_their_index(built: Resources) -> None:
    """Every server runs the sweep every few seconds: among many done erasures, it reads the partial index of the
    running and failed ones (revision 0021) rather than the whole table."""
    rows = [
        {"id": f"erasure_done{i}", "actor": "ops", "user_id": "u", "status": "done", "created_ms": START_MS + i}
        for i in range(5000)
    ]
    async with built.engine.begin() as conn:
        await conn.execute(insert(erasures), rows)
        await conn.execute(
            insert(erasures).values(
                id="erasure_waiting",
                actor="ops",
                user_id="u",
                status="failed",
                created_ms=START_MS,
                retry_at_ms=START_MS,
            )
        )
        await conn.exec_driver_sql("ANALYZE erasures")
    sweep = ErasureLog.sweep(now_ms=START_MS + 1, unclaimed_since_ms=START_MS, limit=8)
    sql = str(sweep.compile(dialect=built.engine.dialect, compile_kwargs={"literal_binds": True}))
    postgres = built.engine.dialect.name == "postgresql"
    async with built.engine.connect() as conn:
        plan = [
            str(row[0] if postgres else row[-1])
            for row in await conn.exec_driver_sql(f"EXPLAIN {sql}" if postgres else f"EXPLAIN QUERY PLAN {sql}")
        ]
        assert [tuple(row) for row in await conn.execute(sweep)] == [("erasure_waiting", "failed")]
    assert any("ix_erasures_created_ms" in line for line in plan), plan
