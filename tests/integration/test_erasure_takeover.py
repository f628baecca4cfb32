"""An erasure is durable work: its replica holds it under a lease it renews while the erasure runs, and when that
replica is killed midway another replica (or the same one, restarted) takes the erasure up once the lease has run out
and finishes it. Before, an erasure whose replica died stayed `running` for ever, half done.

Slow enough to kill midway without a test hook: with encryption on, an erasure waits out every replica's remembered
data keys (STATESTORE_DATA_KEY_CACHE_SECONDS and the database timeout) before it deletes a row."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import anthropic
import openai
import pytest
from sqlalchemy import insert

from statestore.config import Settings
from statestore.erasure_runs import ErasureRuns
from statestore.resources import build_resources
from statestore.sealing import new_key_text
from statestore.store.erasure_log import ErasureLog, ErasureState
from statestore.store.retention_queries import Erasure
from statestore.store.schema import erasures
from statestore.threads.ids import thread_of_response
from tests.support.admin_api import ADMIN_TOKENS, MODEL, AdminApi, Api, error_of, json_of, unique, user
from tests.support.fake_backend import FakeBackend
from tests.support.server import OWNER_SECRET, StatestoreServer

LEASE_SECONDS = 2  # STATESTORE_LEASE_SECONDS: how soon an erasure whose replica died is taken up
REMEMBER_SECONDS = 3  # STATESTORE_DATA_KEY_CACHE_SECONDS: with the settle time, ~6 s each run waits before deleting


@pytest.mark.parametrize("storage", ["postgres", "sqlite"])
def test_an_erasure_whose_replica_is_killed_is_finished_by_another(
    storage: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    fake_backend_process: FakeBackend,
    backend: FakeBackend,
    api_key: str,
) -> None:
    env = {
        "STATESTORE_ENCRYPTION_KEYS": f"k1:{new_key_text()}",
        "STATESTORE_DATA_KEY_CACHE_SECONDS": str(REMEMBER_SECONDS),
        "STATESTORE_DATABASE_TIMEOUT_SECONDS": "2",
        "STATESTORE_LEASE_SECONDS": str(LEASE_SECONDS),
        "STATESTORE_ADMIN_TOKENS": ADMIN_TOKENS,
        "STATESTORE_CHAT_UPSTREAM_URL": fake_backend_process.url,
    }
    replica: Callable[[], StatestoreServer]
    if storage == "postgres":
        url: str = request.getfixturevalue("module_db")
        redis_url: str = request.getfixturevalue("redis_url")
        prefix: str = request.getfixturevalue("module_prefix")

        def replica() -> StatestoreServer:
            return StatestoreServer(
                database_url=url,
                upstream_url=fake_backend_process.url,
                redis_url=redis_url,
                redis_prefix=prefix,
                env=env,
            )

    else:
        from statestore.store.migrate import upgrade

        sqlite_url = f"sqlite+aiosqlite:///{tmp_path / 'statestore.db'}"
        upgrade(sqlite_url)

        def replica() -> StatestoreServer:
            return StatestoreServer(database_url=sqlite_url, upstream_url=fake_backend_process.url, env=env)

    first = replica()
    # PostgreSQL: a second replica, running all along. SQLite (one process at a time): the first, restarted.
    second = replica() if storage == "postgres" else None
    try:
        user_id = unique("user")
        with (
            anthropic.Anthropic(base_url=first.url, api_key=api_key, max_retries=0) as sdk,
            openai.OpenAI(base_url=first.url + "/v1", api_key=api_key, max_retries=0) as client,
            AdminApi(first.url) as admin,
        ):
            thread = sdk.beta.messages.thread(model=MODEL, max_tokens=64, metadata={"user_id": user_id})
            thread.send(user("erase me"))
            response = client.responses.create(model="echo-1", input="erase me too", metadata={"user_id": user_id})
            conversation = client.conversations.create(
                items=[{"type": "message", "role": "user", "content": "and me"}], metadata={"user_id": user_id}
            )
            started = json_of(admin.call("POST", "/erase", {"user_id": user_id}), 202)
        erased_thread = thread_of_response(thread.previous_message_id or "")
        assert erased_thread is not None and started["status"] == "running"

        # Midway: its data keys destroyed, its rows not yet deleted (it waits out the remembered keys).
        time.sleep(1.0)
        first.process.kill()
        first.process.wait()
        first.stop()
        assert "erased" not in first.log(), "the erasure ended before its replica was killed"
        if second is None:
            second = replica()

        with AdminApi(second.url) as admin:
            deadline = time.monotonic() + 45
            state = admin.ok("GET", f"/erasures/{started['id']}")
            while state["status"] == "running":
                assert time.monotonic() < deadline, "the erasure of a killed replica was never finished"
                time.sleep(0.2)
                state = admin.ok("GET", f"/erasures/{started['id']}")
            assert state["status"] == "done", state
            assert (state["erased_threads"], state["erased_responses"], state["erased_conversations"]) == (1, 1, 1)
            assert state["created_at"] == started["created_at"] and state["finished_at"] is not None
            assert "erasure taken up" in second.log()

        # Done: nothing of it is readable on the replica that finished it.
        with (
            Api(second.url, api_key) as api,
            openai.OpenAI(base_url=second.url + "/v1", api_key=api_key, max_retries=0) as client,
        ):
            error_of(api.thread(erased_thread), 404, "not_found_error")
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(response.id)
            with pytest.raises(openai.NotFoundError):
                client.conversations.retrieve(conversation.id)
    finally:
        first.stop()
        if second is not None:
            second.stop()


def running(name: str, now_ms: int) -> ErasureState:
    return ErasureState(
        id=f"erasure_{name}", actor="ops", tenant_id=None, user_id=unique("user"), status="running", created_ms=now_ms
    )


async def test_a_stopped_erasure_is_claimed_once_and_finished_with_what_both_runs_erased(
    scratch_database_url: str,
) -> None:
    """The claim in the row, on the database itself: a live claim is left alone, a claim that ran out is taken by one
    replica only, an erasure begun before claims existed (none) waits a lease, and the erasure taken up ends `done`
    with what the stopped run had recorded and what the new one erased."""
    async with build_resources(
        Settings(database_url=scratch_database_url, owner_secret=OWNER_SECRET), serving=False
    ) as built:
        now = [1_900_000_000_000]
        records = ErasureLog(built.engine)
        stopped, first, second = (
            ErasureRuns(records, built.retention, clock=lambda: now[0], lease_seconds=2) for _ in range(3)
        )
        killed = running("killed", now[0])
        await stopped.begin(killed)
        assert await records.renew(killed.id, token=stopped.token, until_ms=now[0] + 2000, so_far=Erasure(2, 1, 0))
        old = running("older_code", now[0])  # as a replica from before claims begins one: no claim at all
        async with built.engine.begin() as conn:
            await conn.execute(
                insert(erasures).values(
                    id=old.id, actor=old.actor, user_id=old.user_id, status="running", created_ms=old.created_ms
                )
            )

        now[0] += 1000  # both younger than a lease: neither is taken
        assert await first.take_up() == 0
        now[0] += 1500  # the killed run's claim ran out, and the unclaimed erasure is older than a lease
        taken = await asyncio.gather(first.take_up(), second.take_up())
        # Each erasure claimed by one replica only (both by one, or one each, as the two looks interleave).
        assert sum(taken) == 2
        await asyncio.gather(*first._running.values(), *second._running.values())
        done = await records.get(killed.id)
        assert done is not None and done.status == "done" and done.erased == Erasure(2, 1, 0)
        older = await records.get(old.id)
        assert older is not None and older.status == "done" and older.erased == Erasure(0, 0, 0)
        # Ended: neither is taken up again, and the run that stopped cannot renew its claim.
        now[0] += 10_000
        assert await first.take_up() == 0
        assert not await records.renew(killed.id, token=stopped.token, until_ms=now[0], so_far=Erasure(9, 9, 9))
        await first.aclose()
        await second.aclose()
