"""Retention (docs/protocol.md §5, §7, §8; docs/guarantees.md invariant 4): an expired thread is gone for every read at
once; purge (the admin API, the CLI, the background purger) removes its rows and cache keys, in batches, and counts
them; erasure by tenant and by `metadata.user_id`; `DELETE /statestore/v1/threads/{id}` erases at once.

Time moves through the injectable clock (STATESTORE_CLOCK_OFFSET_FILE), never by sleeping. The servers run on a
database of this module's own, since a server whose clock is ahead would purge the threads of every other module."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest

from statestore.retention import Retention
from statestore.store.admin_repository import AdminRepository
from statestore.store.cache_setup import create_cache
from statestore.store.engine import create_engine
from statestore.store.resp_cluster import redis_client
from statestore.store.retention_queries import RetentionQueries
from statestore.threads.ids import new_thread_id, thread_of_response
from tests.support.admin_api import (
    ADMIN_TOKENS,
    MODEL,
    UPSTREAM_KEY,
    AdminApi,
    Api,
    ClockFile,
    Database,
    RedisKeys,
    assert_about,
    cli,
    cli_env,
    cli_json,
    created,
    error_of,
    granted_ttl,
    json_of,
    rfc3339,
    run_async,
    said,
    start_server,
    unique,
    user,
)
from tests.support.fake_backend import FakeBackend
from tests.support.server import StatestoreServer

BATCH = 100


def _env(clock: ClockFile, **extra: str) -> dict[str, str]:
    return {
        "STATESTORE_AUTH_MODE": "keys",
        "STATESTORE_UPSTREAM_API_KEY": UPSTREAM_KEY,
        "STATESTORE_ADMIN_TOKENS": ADMIN_TOKENS,
        "STATESTORE_KEY_CACHE_SECONDS": "0",
        "STATESTORE_CLOCK_OFFSET_FILE": str(clock.path),
        "STATESTORE_PURGE_BATCH_SIZE": str(BATCH),
        **{f"STATESTORE_{name.upper()}": value for name, value in extra.items()},
    }


@pytest.fixture(scope="module")
def server(
    module_db: str, redis_url: str, module_prefix: str, clock: ClockFile, fake_backend_process: FakeBackend
) -> Iterator[StatestoreServer]:
    """Purges only when asked: its background purger waits an hour."""
    running = start_server(
        module_db, fake_backend_process.url, redis_url, module_prefix, _env(clock, purge_interval_seconds="3600")
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def admin(server: StatestoreServer) -> Iterator[AdminApi]:
    with AdminApi(server.url) as api:
        yield api


@pytest.fixture(scope="module")
def db(module_db: str) -> Database:
    return Database(module_db)


@pytest.fixture(scope="module")
def cache(redis_url: str, module_prefix: str) -> Iterator[RedisKeys]:
    keys = RedisKeys(redis_url, module_prefix)
    yield keys
    keys.close()


@pytest.fixture
def api(server: StatestoreServer, admin: AdminApi) -> Iterator[Api]:
    """A new tenant's client."""
    _, key = admin.tenant_with_key()
    with Api(server.url, key) as client:
        yield client


def _both_keys(cache: RedisKeys, thread_id: str) -> list[str]:
    return [f"{cache.prefix}{{{thread_id}}}:h", f"{cache.prefix}{{{thread_id}}}:n"]


# == expiry and purge =================================================================================================


def test_an_expired_thread_is_gone_at_once_and_purge_removes_every_byte(
    server: StatestoreServer, admin: AdminApi, db: Database, cache: RedisKeys, clock: ClockFile
) -> None:
    tenant, key = admin.tenant_with_key()
    other, _ = admin.tenant_with_key()
    api = Api(server.url, key)
    session = unique("sess")
    response = api.create("expiring", session=session)
    assert_about(granted_ttl(response, now=clock.now()), 300)
    thread_id, head = created(response)
    _, head = created(api.continue_(head, "second"))
    keeper, keeper_head = created(api.create("keeper", ttl=5000))
    assert db.rows_of(thread_id) == (1, 4, 1)
    assert cache.keys_of(thread_id) == _both_keys(cache, thread_id)

    # The TTL slides: a turn 200 s on grants another 300 s from then.
    clock.advance(200)
    response = api.continue_(head, "third")
    _, head = created(response)
    assert_about(granted_ttl(response, now=clock.now()), 300)
    clock.advance(299)
    assert json_of(api.thread(thread_id))["message_count"] == 6

    # Past its expiry, gone for every read at once, purged or not.
    clock.advance(2)
    error_of(api.continue_(head, "too late"), 404, "not_found_error", "thread_not_found")
    error_of(api.thread(thread_id), 404, "not_found_error")
    error_of(api.export(thread_id), 404, "not_found_error")
    error_of(api.session_info(session), 404, "not_found_error")
    assert api.thread_ids() == [keeper]
    assert json_of(api.threads(session_id=session))["data"] == []
    assert db.rows_of(thread_id) == (1, 6, 1)
    stats = admin.stats()
    assert stats["expired_awaiting_purge"] >= 1
    assert stats["live_threads"] >= 1
    mine = admin.stats(tenant["id"])
    assert (mine["live_threads"], mine["live_messages"], mine["expired_awaiting_purge"]) == (1, 2, 1)
    assert admin.stats(other["name"])["expired_awaiting_purge"] == 0

    purged = admin.purge()
    assert purged >= 1
    assert db.rows_of(thread_id) == (0, 0, 0)
    assert cache.keys_of(thread_id) == []
    after = admin.stats()
    assert after["purged_threads_total"] == stats["purged_threads_total"] + purged
    assert after["expired_awaiting_purge"] == 0
    # The live thread kept everything, and goes on.
    assert db.rows_of(keeper) == (1, 2, 0)
    assert cache.keys_of(keeper) == _both_keys(cache, keeper)
    created(api.continue_(keeper_head, "still here"))
    # The session name is free for a new thread, which starts empty.
    fresh, _ = created(api.session(session, "anew"))
    assert fresh != thread_id
    assert json_of(api.thread(fresh))["message_count"] == 2
    api.close()


def test_an_expired_thread_is_gone_for_the_sdk_which_replays(
    server: StatestoreServer, admin: AdminApi, backend: FakeBackend, clock: ClockFile
) -> None:
    _, key = admin.tenant_with_key()
    with anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0) as sdk:
        thread = sdk.beta.messages.thread(model=MODEL, max_tokens=64)
        first = thread.send(user("one"))
        clock.advance(301)
        second = thread.send(user("two"))
    # The SDK got thread_not_found and replayed the whole conversation into a new thread.
    assert thread_of_response(second.id) not in (None, thread_of_response(first.id))
    assert backend.requests()[-1].json()["messages"] == [user("one"), said("one"), user("two")]


def test_the_purge_command_uses_the_same_clock(
    api: Api, db: Database, cache: RedisKeys, clock: ClockFile, module_db: str, redis_url: str, module_prefix: str
) -> None:
    thread_id, _ = created(api.create("short", ttl=5))
    clock.advance(6)
    env = cli_env(
        module_db,
        redis_url=redis_url,
        redis_prefix=module_prefix,
        clock_offset_file=str(clock.path),
        purge_batch_size="7",
    )
    # `statestore admin purge` (test_admin runs its twin, `statestore purge`).
    assert cli_json(cli(env, "admin", "purge", "--json", "--actor", "cli:retention"))["purged_threads"] >= 1
    assert db.rows_of(thread_id) == (0, 0, 0)
    assert cache.keys_of(thread_id) == []


def test_the_background_purger_removes_expired_threads_within_its_interval(
    api: Api,
    db: Database,
    cache: RedisKeys,
    clock: ClockFile,
    module_db: str,
    redis_url: str,
    module_prefix: str,
    fake_backend_process: FakeBackend,
) -> None:
    interval = 0.5
    purger = start_server(
        module_db, fake_backend_process.url, redis_url, module_prefix, _env(clock, purge_interval_seconds=str(interval))
    )
    try:
        thread_id, _ = created(api.create("background", ttl=10))
        assert cache.keys_of(thread_id)
        clock.advance(11)
        started = time.monotonic()
        # Rows go first and the cache keys right after, in the same purge run.
        while db.rows_of(thread_id) != (0, 0, 0) or cache.keys_of(thread_id):
            assert time.monotonic() - started < 4 * interval + 2, "the background purger did not run in time"
            time.sleep(0.05)
        waited = time.monotonic() - started
        assert waited <= 2 * interval + 1, f"purged after {waited:.2f}s, interval {interval}s"
    finally:
        purger.stop()


def test_a_large_backlog_is_purged_completely_in_batches(
    admin: AdminApi,
    db: Database,
    cache: RedisKeys,
    clock: ClockFile,
    module_db: str,
    redis_url: str,
    module_prefix: str,
) -> None:
    now = int(clock.now() * 1000)
    doomed = _insert_threads(db, cache, 1200, owner="t:backlog", expires_ms=now - 60_000)
    # Expired but held by a request still running: not purged while its lease lasts.
    (leased,) = _insert_threads(db, cache, 1, owner="t:backlog", expires_ms=now - 1, lease_until_ms=now + 60_000)
    (live,) = _insert_threads(db, cache, 1, owner="t:backlog", expires_ms=now + 600_000)
    before = admin.stats()
    assert before["expired_awaiting_purge"] >= 1201

    purged = admin.purge()
    assert purged >= 1200
    assert db.value("SELECT count(*) FROM threads WHERE id = ANY($1::text[])", doomed) == 0
    assert db.value("SELECT count(*) FROM thread_messages WHERE thread_id = ANY($1::text[])", doomed) == 0
    assert db.value("SELECT count(*) FROM sessions WHERE thread_id = ANY($1::text[])", doomed) == 0
    assert not any(cache.client.exists(*_both_keys(cache, thread_id)) for thread_id in doomed[:300])
    assert db.rows_of(leased) == (1, 2, 1)
    assert db.rows_of(live) == (1, 2, 1)
    assert cache.keys_of(live) == _both_keys(cache, live)
    after = admin.stats()
    assert after["purged_threads_total"] == before["purged_threads_total"] + purged
    assert after["expired_awaiting_purge"] == 1
    assert admin.audit(limit=1)[0]["action"] == "purge"
    assert admin.audit(limit=1)[0]["after"] == {"threads": purged, "responses": 0, "conversations": 0}

    clock.advance(61)
    assert admin.purge() == 1
    assert db.rows_of(leased) == (0, 0, 0)
    assert db.rows_of(live) == (1, 2, 1)

    # In batches of STATESTORE_PURGE_BATCH_SIZE: the same Retention the server runs, with its batches recorded.
    now = int(clock.now() * 1000)
    more = _insert_threads(db, cache, 250, owner="t:backlog", expires_ms=now - 1)
    batches = run_async(lambda: _purge_recording_batches(module_db, redis_url, module_prefix, now))
    assert batches == [100, 100, 50]
    assert db.value("SELECT count(*) FROM threads WHERE id = ANY($1::text[])", more) == 0


def _insert_threads(
    db: Database, cache: RedisKeys, count: int, *, owner: str, expires_ms: int, lease_until_ms: int | None = None
) -> list[str]:
    """Threads of two messages each, with a session and Redis keys, written straight into the stores."""
    ids = [new_thread_id() for _ in range(count)]
    created_ms = expires_ms - 300_000
    db.execute_many(
        "INSERT INTO threads (id, owner, head_message_id, head_position, byte_count, turn_count, lease_token, "
        "lease_expires_ms, ttl_seconds, created_ms, updated_ms, expires_ms) "
        "VALUES ($1, $2, $3, 2, 40, 1, $4, $5, 300, $6, $6, $7)",
        [
            (
                thread_id,
                owner,
                "msg_" + thread_id[4:] + "x" * 22,
                "lease" if lease_until_ms else None,
                lease_until_ms,
                created_ms,
                expires_ms,
            )
            for thread_id in ids
        ],
    )
    db.execute_many(
        "INSERT INTO thread_messages (thread_id, position, body) VALUES ($1, $2, $3)",
        [(thread_id, position, b'{"role":"user","content":"x"}') for thread_id in ids for position in (0, 1)],
    )
    db.execute_many(
        "INSERT INTO sessions (owner, name, thread_id, updated_ms) VALUES ($1, $2, $3, $4)",
        [(owner, f"s-{thread_id}", thread_id, created_ms) for thread_id in ids],
    )
    with cache.client.pipeline(transaction=False) as pipe:
        for thread_id in ids[:300]:
            h, n = _both_keys(cache, thread_id)
            pipe.set(h, b'{"role":"user","content":"x"}', px=600_000)
            pipe.set(n, b"1", px=600_000)
        pipe.execute()
    return ids


class _RecordingQueries(RetentionQueries):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[int] = []

    async def purge_expired(self, *, now_ms: int, batch_size: int) -> list[str]:
        ids = await super().purge_expired(now_ms=now_ms, batch_size=batch_size)
        self.batches.append(len(ids))
        return ids


async def _purge_recording_batches(database_url: str, redis_url: str, prefix: str, now_ms: int) -> list[int]:
    engine = create_engine(database_url, pool_size=1)
    redis = redis_client(redis_url)
    cache = create_cache(redis, prefix)
    try:
        queries = _RecordingQueries(engine)
        retention = Retention(
            queries=queries, admin=AdminRepository(engine), cache=cache, clock=lambda: now_ms, batch_size=BATCH
        )
        await retention.purge()
        return queries.batches
    finally:
        await redis.aclose()
        await engine.dispose()


# == erasure and delete ===============================================================================================


def test_erasure_by_tenant_by_user_and_by_both(
    server: StatestoreServer, admin: AdminApi, db: Database, cache: RedisKeys, clock: ClockFile
) -> None:
    t1, key1 = admin.tenant_with_key()
    _, key2 = admin.tenant_with_key()
    u1, u2, u3 = unique("u1"), unique("u2"), unique("u3")
    with (
        Api(server.url, key1) as one,
        Api(server.url, key2) as two,
        anthropic.Anthropic(base_url=server.url, api_key=key1, max_retries=0) as sdk,
    ):
        helper = sdk.beta.messages.thread(model=MODEL, max_tokens=64, metadata={"user_id": u1})
        helper.send(user("t1 u1 helper"))
        helper.send(user("t1 u1 helper again"))
        a = thread_of_response(helper.previous_message_id or "")
        assert a is not None
        b, _ = created(one.create("t1 u1 session", session=unique("s"), metadata={"user_id": u1}))
        c, _ = created(one.create("t1 u2", metadata={"user_id": u2}))
        f, _ = created(one.create("t1 nobody"))
        d, _ = created(two.create("t2 u1", metadata={"user_id": u1}))
        e, e_head = created(two.create("t2 nobody"))
        # Erasure takes expired threads too, purged or not.
        g, _ = created(two.create("t2 u3 short", ttl=1, metadata={"user_id": u3}))
        clock.advance(2)
        everything = (a, b, c, d, e, f, g)
        for thread_id in everything:
            assert db.rows_of(thread_id)[0] == 1
        before = admin.stats()["erased_threads_total"]

        def remaining() -> set[str]:
            return {t for t in everything if db.rows_of(t) != (0, 0, 0) or cache.keys_of(t)}

        def threads(count: int) -> dict[str, int]:
            return {"erased_threads": count, "erased_responses": 0, "erased_conversations": 0}

        assert admin.erase({"tenant": t1["name"], "user_id": u1}) == threads(2)
        assert remaining() == {c, d, e, f, g}
        assert admin.erase({"user_id": u1}) == threads(1)
        assert remaining() == {c, e, f, g}
        assert admin.erase({"tenant": t1["id"]}) == threads(2)
        assert remaining() == {e, g}
        assert admin.erase({"user_id": u3}) == threads(1)
        assert remaining() == {e}
        assert admin.stats()["erased_threads_total"] == before + 6

        assert one.thread_ids() == []
        assert two.thread_ids() == [e]
        assert cache.keys_of(e) == _both_keys(cache, e)
        created(two.continue_(e_head, "untouched"))

        error_of(admin.call("POST", "/erase", {}), 400, "invalid_request_error")
        error_of(admin.call("POST", "/erase", {"user_id": ""}), 400, "invalid_request_error")
        error_of(admin.call("POST", "/erase", {"tenant": "no-such-tenant"}), 404, "not_found_error")
        error_of(admin.call("POST", "/erase", {"tenant": t1["id"], "extra": 1}), 400, "invalid_request_error")


def test_delete_removes_rows_and_cache_keys_at_once(api: Api, db: Database, cache: RedisKeys, clock: ClockFile) -> None:
    thread_id, head = created(api.create("delete me", session=unique("s")))
    created(api.continue_(head, "twice"))
    assert db.rows_of(thread_id) == (1, 4, 1)
    assert cache.keys_of(thread_id) == _both_keys(cache, thread_id)
    json_of(api.delete(thread_id))
    assert db.rows_of(thread_id) == (0, 0, 0)
    assert cache.keys_of(thread_id) == []

    # An expired thread is 404 to its owner, and its delete erases what is left of it all the same.
    expired, _ = created(api.create("expired", ttl=1))
    clock.advance(2)
    error_of(api.delete(expired), 404, "not_found_error")
    assert db.rows_of(expired) == (0, 0, 0)
    assert cache.keys_of(expired) == []


def test_a_slow_reply_gets_its_whole_ttl_from_when_it_is_stored(
    api: Api, backend: FakeBackend, clock: ClockFile
) -> None:
    # The reply takes 400 s of the servers' time (a long extended-thinking turn, say); the TTL is 300 s.
    backend.script({"kind": "echo", "delay_seconds": 1.0})
    timer = threading.Timer(0.3, clock.advance, (400,))
    timer.start()
    try:
        response = api.create("a slow one")
    finally:
        timer.join()
    thread_id, head = created(response)
    info = json_of(api.thread(thread_id))
    assert rfc3339(info["expires_at"]) - rfc3339(info["last_used_at"]) == pytest.approx(300, abs=1)
    created(api.continue_(head, "and the next turn"))
