"""Claims on thread heads (store/thread_claims.py): a continue by response id whose thread Redis holds claims its head
there and takes no lease in PostgreSQL; whatever Redis says, PostgreSQL's commit decides, so a claim lost with Redis
or a row older than the database costs a turn its commit and never forks a thread."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import asyncpg
import httpx
import pytest
import redis

from statestore.store.pg_hot_path import asyncpg_dsn
from statestore.store.redis_cache import RedisHistoryCache
from statestore.store.resp_cluster import redis_client
from statestore.store.thread_claims import claim_name
from tests.integration.test_threads import RawThreads, ok, thread_error, user
from tests.support.fake_backend import FakeBackend
from tests.support.redis_keys import own_redis_prefix
from tests.support.server import StatestoreServer


def _lease(database_url: str, thread_id: str) -> str | None:
    async def read() -> str | None:
        conn = await asyncpg.connect(asyncpg_dsn(database_url))
        try:
            token: str | None = await conn.fetchval("SELECT lease_token FROM threads WHERE id = $1", thread_id)
            return token
        finally:
            await conn.close()

    return asyncio.run(read())


def _poll(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


class Keys:
    """The Redis keys of one thread under a server's prefix."""

    def __init__(self, client: redis.Redis, prefix: str, thread_id: str) -> None:
        self._client = client
        self._tagged = f"{prefix}{{{thread_id}}}"

    def claim(self, head: str) -> bytes | None:
        """The claim on one head (a claim is per head and owner: store/thread_claims.py claim_name)."""
        found = list(self._client.scan_iter(match=f"{self._tagged}:c:{head}:*"))
        assert len(found) <= 1, found
        return cast(bytes | None, self._client.get(found[0])) if found else None

    def drop_claim(self, head: str) -> None:
        for key in self._client.scan_iter(match=f"{self._tagged}:c:{head}:*"):
            self._client.delete(key)

    def row(self) -> bytes | None:
        return cast(bytes | None, self._client.get(f"{self._tagged}:r"))

    def drop(self, suffix: str) -> None:
        self._client.delete(f"{self._tagged}:{suffix}")

    def claims(self) -> list[bytes]:
        return list(self._client.scan_iter(match=f"{self._tagged}:c:*"))


@pytest.fixture
def kv(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def raw(pg_server: StatestoreServer, api_key: str) -> Iterator[RawThreads]:
    threads = RawThreads(pg_server.url, api_key)
    yield threads
    threads.close()


@pytest.fixture(scope="module")
def leasing_server(
    migrated_pg_url: str, redis_url: str, fake_backend_process: FakeBackend
) -> Iterator[StatestoreServer]:
    """A replica on the same database that leases in PostgreSQL (claims off), with a cache of its own: a release
    before claims, or one whose Redis entries the claiming replica never sees."""
    with _replica(migrated_pg_url, redis_url, fake_backend_process, {"STATESTORE_REDIS_CLAIMS": "false"}) as server:
        yield server


@contextmanager
def _replica(
    database_url: str, redis_url: str, backend: FakeBackend, env: dict[str, str]
) -> Iterator[StatestoreServer]:
    """Another replica on the same database, with settings and a Redis prefix of its own."""
    with own_redis_prefix(redis_url) as prefix:
        server = StatestoreServer(
            database_url=database_url, upstream_url=backend.url, redis_url=redis_url, redis_prefix=prefix, env=env
        )
        try:
            yield server
        finally:
            server.stop()


def _slow_continue(
    client: RawThreads, backend: FakeBackend, head: str, marker: str, delay: float
) -> tuple[threading.Thread, dict[str, httpx.Response]]:
    """A continue of `head` whose reply the backend holds back `delay` seconds, in flight once the backend has it."""
    backend.script({"kind": "echo", "match": marker, "delay_seconds": delay})
    runner, result = _in_flight(lambda: client.continue_(head, [user(marker)]))
    _poll(_started(backend, marker), f"the turn {marker!r} to reach the backend")
    return runner, result


def _in_flight(call: Callable[[], httpx.Response]) -> tuple[threading.Thread, dict[str, httpx.Response]]:
    result: dict[str, httpx.Response] = {}

    def run() -> None:
        result["response"] = call()

    runner = threading.Thread(target=run)
    runner.start()
    return runner, result


def _heads(server: StatestoreServer) -> dict[str, float]:
    """thread_heads_total by how the head was held, from the server's /metrics."""
    text = httpx.get(f"{server.url}/metrics").text
    found = re.findall(r'^thread_heads_total\{held="(\w+)"\} ([0-9.e+]+)$', text, re.M)
    return {held: float(value) for held, value in found}


def _started(backend: FakeBackend, marker: str) -> Callable[[], bool]:
    return lambda: any(marker.encode() in request.body for request in backend.requests())


def test_a_continue_claims_the_head_in_redis_and_leases_nothing_in_the_database(
    raw: RawThreads,
    backend: FakeBackend,
    kv: redis.Redis,
    server_redis_prefix: str,
    migrated_pg_url: str,
    pg_server: StatestoreServer,
) -> None:
    heads = _heads(pg_server)
    created = raw.create([user("one")])
    thread_id = created.headers["statestore-thread-id"]
    keys = Keys(kv, server_redis_prefix, thread_id)
    assert keys.row() is not None  # the create's commit left the row beside the history
    runner, result = _slow_continue(raw, backend, ok(created)["id"], "claimed-two", 1.5)
    assert keys.claim(ok(created)["id"]) is not None
    assert _lease(migrated_pg_url, thread_id) is None
    rival = raw.continue_(ok(created)["id"], [user("rival")])
    thread_error(rival, 400, "thread_continue_in_flight")
    runner.join(timeout=20)
    second = ok(result["response"])
    assert keys.claims() == []  # freed by the commit
    assert raw.info(thread_id)["message_count"] == 4
    # The next continue is claimed again, from the row the last commit left.
    assert ok(raw.continue_(second["id"], [user("three")]))["content"][0]["text"] == "echo: three"
    assert raw.info(thread_id)["message_count"] == 6
    assert not any(b"rival" in request.body for request in backend.requests())
    after = _heads(pg_server)
    assert (after["claim"] - heads["claim"], after["lease"] - heads["lease"]) == (2, 0)


def test_without_its_row_a_continue_leases_in_the_database_and_keeps_the_claim(
    raw: RawThreads,
    backend: FakeBackend,
    kv: redis.Redis,
    server_redis_prefix: str,
    migrated_pg_url: str,
    pg_server: StatestoreServer,
) -> None:
    heads = _heads(pg_server)
    created = raw.create([user("one")])
    thread_id = created.headers["statestore-thread-id"]
    keys = Keys(kv, server_redis_prefix, thread_id)
    keys.drop("r")
    runner, result = _slow_continue(raw, backend, ok(created)["id"], "leased-two", 1.5)
    token = _lease(migrated_pg_url, thread_id)
    assert token is not None and keys.claim(ok(created)["id"]) == token.encode()
    runner.join(timeout=20)
    second = ok(result["response"])
    assert _lease(migrated_pg_url, thread_id) is None and keys.claims() == []
    assert keys.row() is not None  # written again by the commit: the next continue is claimed
    runner, result = _slow_continue(raw, backend, second["id"], "claimed-three", 1.0)
    assert _lease(migrated_pg_url, thread_id) is None and keys.claim(second["id"]) is not None
    runner.join(timeout=20)
    ok(result["response"])
    assert raw.info(thread_id)["message_count"] == 6
    after = _heads(pg_server)
    assert (after["claim_and_lease"] - heads["claim_and_lease"], after["claim"] - heads["claim"]) == (1, 1)


def test_a_claim_lost_with_redis_costs_one_turn_its_commit_not_a_fork(
    raw: RawThreads, backend: FakeBackend, kv: redis.Redis, server_redis_prefix: str
) -> None:
    created = raw.create([user("one")])
    thread_id = created.headers["statestore-thread-id"]
    head = ok(created)["id"]
    keys = Keys(kv, server_redis_prefix, thread_id)
    backend.script(
        {"kind": "echo", "match": "first-of-two", "delay_seconds": 1.5},
        {"kind": "echo", "match": "second-of-two", "delay_seconds": 0.2},
    )
    first, first_result = _in_flight(lambda: raw.continue_(head, [user("first-of-two")]))
    _poll(_started(backend, "first-of-two"), "the first turn to reach the backend")
    keys.drop_claim(head)  # Redis lost the claim (a restart, a failover)
    second = raw.continue_(head, [user("second-of-two")])
    first.join(timeout=20)
    # Both reached the backend; the second committed first, and the first finds the head moved.
    assert ok(second)["content"][0]["text"] == "echo: second-of-two"
    thread_error(first_result["response"], 400, "thread_already_continued")
    assert raw.info(thread_id)["message_count"] == 4
    assert keys.claims() == []  # each freed its own claim
    messages = raw.http.get(f"/statestore/v1/threads/{thread_id}/messages").json()["messages"]
    assert [m["content"] for m in messages if m["role"] == "user"][-1] == "second-of-two"


def test_a_row_older_than_the_database_is_refused_at_commit_with_nothing_stored(
    raw: RawThreads, backend: FakeBackend, leasing_server: StatestoreServer, api_key: str
) -> None:
    created = raw.create([user("one")])
    thread_id = created.headers["statestore-thread-id"]
    head = ok(created)["id"]
    other = RawThreads(leasing_server.url, api_key)
    try:
        # Another replica continues the thread; this one's Redis entries never hear of it.
        ok(other.continue_(head, [user("elsewhere")]))
    finally:
        other.close()
    before = len(backend.requests())
    stale = raw.continue_(head, [user("from-the-old-head")])
    thread_error(stale, 400, "thread_already_continued")
    assert len(backend.requests()) == before + 1  # the row looked current: the backend was asked, nothing kept
    assert raw.info(thread_id)["message_count"] == 4


def test_a_live_database_lease_refuses_a_claimed_commit(
    raw: RawThreads, backend: FakeBackend, leasing_server: StatestoreServer, api_key: str, migrated_pg_url: str
) -> None:
    created = raw.create([user("one")])
    thread_id = created.headers["statestore-thread-id"]
    head = ok(created)["id"]
    other = RawThreads(leasing_server.url, api_key)
    try:
        runner, result = _slow_continue(other, backend, head, "leased-elsewhere", 1.5)
        assert _lease(migrated_pg_url, thread_id) is not None
        claimed = raw.continue_(head, [user("claimed-here")])
        thread_error(claimed, 400, "thread_continue_in_flight")
        runner.join(timeout=20)
        ok(result["response"])
    finally:
        other.close()
    assert raw.info(thread_id)["message_count"] == 4
    messages: list[dict[str, Any]] = raw.http.get(f"/statestore/v1/threads/{thread_id}/messages").json()["messages"]
    assert [m["content"] for m in messages if m["role"] == "user"][-1] == "leased-elsewhere"


def test_with_claims_off_a_continue_leases_in_the_database(
    leasing_server: StatestoreServer,
    backend: FakeBackend,
    kv: redis.Redis,
    api_key: str,
    migrated_pg_url: str,
) -> None:
    other = RawThreads(leasing_server.url, api_key)
    try:
        created = other.create([user("one")])
        thread_id = created.headers["statestore-thread-id"]
        runner, result = _slow_continue(other, backend, ok(created)["id"], "unclaimed-two", 1.0)
        assert _lease(migrated_pg_url, thread_id) is not None
        assert not list(kv.scan_iter(match=f"*{{{thread_id}}}:[cr]*"))
        runner.join(timeout=20)
        ok(result["response"])
    finally:
        other.close()


def test_a_thread_near_its_expiry_is_leased_in_the_database(
    raw: RawThreads, backend: FakeBackend, kv: redis.Redis, server_redis_prefix: str, migrated_pg_url: str
) -> None:
    """A claimed turn does not keep its thread from the purger: one that could outlast the thread is leased."""
    created = raw.create([user("one")], headers={"statestore-ttl": "60"})  # less than the 120 s lease
    thread_id = created.headers["statestore-thread-id"]
    keys = Keys(kv, server_redis_prefix, thread_id)
    assert keys.row() is not None
    runner, result = _slow_continue(raw, backend, ok(created)["id"], "near-expiry", 1.0)
    assert _lease(migrated_pg_url, thread_id) is not None
    runner.join(timeout=20)
    ok(result["response"])


@pytest.fixture(scope="module")
def short_lease_server(
    migrated_pg_url: str, redis_url: str, fake_backend_process: FakeBackend
) -> Iterator[StatestoreServer]:
    with _replica(migrated_pg_url, redis_url, fake_backend_process, {"STATESTORE_LEASE_SECONDS": "1"}) as server:
        yield server


def test_a_claimed_turn_longer_than_a_third_of_the_lease_takes_the_database_lease_and_commits(
    short_lease_server: StatestoreServer, backend: FakeBackend, api_key: str, migrated_pg_url: str
) -> None:
    raw = RawThreads(short_lease_server.url, api_key)
    try:
        created = raw.create([user("one")])
        thread_id = created.headers["statestore-thread-id"]
        runner, result = _slow_continue(raw, backend, ok(created)["id"], "long-claimed", 2.5)
        assert _lease(migrated_pg_url, thread_id) is None  # claimed
        # At its first renewal (a third of the lease) the turn takes the database's lease on its head.
        _poll(lambda: _lease(migrated_pg_url, thread_id) is not None, "the claimed turn to take the lease")
        rival = raw.continue_(ok(created)["id"], [user("rival")])
        thread_error(rival, 400, "thread_continue_in_flight")
        runner.join(timeout=20)
        ok(result["response"])
        assert _lease(migrated_pg_url, thread_id) is None  # given back by the commit
        assert raw.info(thread_id)["message_count"] == 4
    finally:
        raw.close()


async def test_a_claim_is_per_owner_so_another_owner_naming_the_head_never_holds_it(redis_url: str) -> None:
    """A request naming another owner's head is refused (the row and the lease are not its), but it claims before it
    knows: its claim must not be the owner's, or a stranger's request, for an instant, refuses the owner's turn
    (thread_continue_in_flight). Two turns of one owner on one head still exclude each other."""
    with own_redis_prefix(redis_url) as prefix:
        client = redis_client(redis_url)
        claims = RedisHistoryCache(client, prefix).thread_claims()
        assert claims is not None
        try:

            async def claim(owner: str, token: str) -> bool:
                found = await claims.claim(
                    "thr_x", owner=owner, response_id="msg_head", token=token, lease_ms=60_000, now_ms=0
                )
                return found.held

            assert await claim("stranger", "t1")
            assert await claim("owner", "t2")
            assert not await claim("owner", "t3")
            await claims.release("thr_x", claim_name("msg_head", "owner"), "t2")
            assert await claim("owner", "t3")
        finally:
            await client.aclose()
