"""Faults around a running statestore: the Redis cache lost, stale, evicted, down or hung, and a model backend that
errors, refuses connections, cuts or stalls its streams, and clients that leave mid-stream.

What must hold (docs/guarantees.md invariants 1 and 3, docs/protocol.md §2 and §4): the database is the truth, so a
thread keeps working whatever happens to Redis and the request rebuilt for a thread state is byte for byte the one
rebuilt before the fault; a failed turn stores nothing and leaves its id continuable; and 1,000 failed turns leak no
file descriptor, database connection or lease.

The byte comparisons pair two requests for the same thread state: a continue that the fake backend answers with a
scripted 500 (so the head does not move), then the same continue again. Which of the two the cache served and which
the database rebuilt is checked through `/metrics` (`cache_lookups_total`).
"""

from __future__ import annotations

import secrets
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
import pytest
import redis
from sqlalchemy.engine import make_url

from statestore.store.migrate import upgrade
from statestore.threads.ids import thread_of_response
from tests.reliability.support import (
    THREADS_BETA,
    PrivateRedis,
    RawClient,
    ServerProcess,
    echo,
    error_of,
    held_leases,
    open_descriptors,
    private_redis,
    query,
    running_server,
    scalar,
    sse_data,
    statestore_connections,
    stored_threads,
    user,
    wait_for,
)
from tests.support.fake_backend import FakeBackend, error_action
from tests.support.server import free_port

SYSTEM = 'You answer in one short sentence. Ünïcödé, "quotes", \u2028 and emoji 🙂 stay byte-exact.'
TOOL: dict[str, Any] = {
    "name": "get_weather",
    "description": "The weather of a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
# Longer than any wait a test expects, shorter than the default 600 s: a stall past it must fail the turn.
READ_TIMEOUT_SECONDS = 1.0
STALL_SECONDS = 2.5


def new_key() -> str:
    return f"sk-reliability-{secrets.token_hex(8)}"


@pytest.fixture(scope="module")
def fake_backend() -> Iterator[FakeBackend]:
    with FakeBackend() as backend:
        yield backend


@pytest.fixture
def backend(fake_backend: FakeBackend) -> FakeBackend:
    fake_backend.reset()
    return fake_backend


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    """The value of one Prometheus sample of the server (0 when absent)."""
    wanted = name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
    for line in httpx.get(server.url + "/metrics", timeout=5).text.splitlines():
        sample, _, value = line.rpartition(" ")
        if sample == wanted:
            return float(value)
    return 0.0


def lookups(server: ServerProcess) -> Counter[str]:
    return Counter(
        {result: metric(server, "cache_lookups_total", result=result) for result in ("hit", "miss", "stale")}
    )


def readyz(server: ServerProcess) -> tuple[int, dict[str, Any]]:
    response = httpx.get(server.url + "/readyz", timeout=10)
    body: dict[str, Any] = response.json()
    return response.status_code, body


# == cache faults ====================================================================================================
# statestore on the shared PostgreSQL and a Redis of this module's own, which the tests flush, fill, kill and pause.

PREFIX = "ss:"


def cache_keys(thread_id: str) -> tuple[str, str]:
    return f"{PREFIX}{{{thread_id}}}:h", f"{PREFIX}{{{thread_id}}}:n"


@pytest.fixture(scope="module")
def cache_redis() -> Iterator[PrivateRedis]:
    with private_redis() as instance:
        yield instance


@pytest.fixture(scope="module")
def cache_server(migrated_pg_url: str, cache_redis: PrivateRedis, fake_backend: FakeBackend) -> Iterator[ServerProcess]:
    with running_server(
        database_url=migrated_pg_url, upstream_url=fake_backend.url, redis_url=cache_redis.url, redis_prefix=PREFIX
    ) as server:
        yield server


@pytest.fixture
def redis_up(cache_redis: PrivateRedis) -> Iterator[PrivateRedis]:
    """The module's Redis running, empty, without a memory limit, at the start and at the end of each test."""

    def reset() -> None:
        cache_redis.resume()
        if cache_redis.process is None or cache_redis.process.poll() is not None:
            cache_redis.start()
        with cache_redis.client() as client:
            client.config_set("maxmemory", 0)
            client.config_set("maxmemory-policy", "noeviction")
            client.flushall()

    reset()
    yield cache_redis
    reset()


def build_thread(raw: RawClient, tag: str, *, turns: int = 3, size: int = 0, **fields: Any) -> list[dict[str, Any]]:
    """A thread of `turns` stored turns (system and tools on the create); the replies, oldest first."""
    filler = "x" * size
    replies = [raw.ok([user(f"{tag} turn 0 — ünïcödé \u2028 {filler}")], system=SYSTEM, tools=[TOOL], **fields)]
    for turn in range(1, turns):
        replies.append(raw.ok([user(f"{tag} turn {turn} {filler}")], replies[-1]["id"], **fields))
    return replies


def scripted_failure_body(backend: FakeBackend, raw: RawClient, head_id: str, text: str, **fields: Any) -> bytes:
    """The body statestore forwards for a continue from `head_id`, which the backend answers 500: nothing is stored
    and the head stays, so the same continue can be sent again for the same thread state."""
    backend.script(error_action(500, "api_error", "scripted failure"))
    response = raw.turn([user(text)], head_id, **fields)
    assert response.status_code == 500, response.text
    assert error_of(response)["message"] == "scripted failure"
    return backend.requests()[-1].body


def assert_rebuilt_from(body: bytes, raw: RawClient, thread_id: str, text: str) -> None:
    """`body` is the thread as exported (docs/protocol.md §7), plus the new turn: right, not only identical."""
    exported = raw.export(thread_id)
    sent = orjson.loads(body)
    assert sent["system"] == exported["system"] == SYSTEM
    assert sent["tools"] == exported["tools"] == [TOOL]
    assert sent["messages"] == [*exported["messages"], user(text)]


@pytest.mark.parametrize("fault", ["delete_keys", "delete_history_key", "flushall", "stale_entry"])
def test_lost_or_stale_cache_entry_rebuilds_the_same_bytes(
    fault: str, cache_server: ServerProcess, redis_up: PrivateRedis, backend: FakeBackend
) -> None:
    raw = RawClient(cache_server.url, new_key())
    cache = redis_up.client()
    try:
        first = raw.ok([user("turn 0 — ünïcödé \u2028 🙂")], system=SYSTEM, tools=[TOOL])
        thread_id = thread_of_response(first["id"])
        assert thread_id is not None
        joined_key, count_key = cache_keys(thread_id)
        after_first = (cache.get(joined_key), cache.get(count_key))
        assert after_first[1] == b"2:2"
        second = raw.ok([user("turn 1")], first["id"])
        head = raw.ok([user("turn 2")], second["id"])["id"]
        assert cache.get(count_key) == b"2:6"

        before = lookups(cache_server)
        from_cache = scripted_failure_body(backend, raw, head, "turn 3")
        assert lookups(cache_server) - before == Counter(hit=1)

        if fault == "delete_keys":
            assert cache.delete(joined_key, count_key) == 2
        elif fault == "delete_history_key":
            assert cache.delete(joined_key) == 1  # the count alone is left, as after a partial eviction
        elif fault == "flushall":
            cache.flushall()
        else:  # an entry from an earlier state of the thread: the count says 2 messages, the thread has 6
            cache.set(joined_key, after_first[0] or b"", px=60_000)
            cache.set(count_key, after_first[1] or b"", px=60_000)

        before = lookups(cache_server)
        from_database = scripted_failure_body(backend, raw, head, "turn 3")
        assert lookups(cache_server) - before == Counter(stale=1) if fault == "stale_entry" else Counter(miss=1)
        assert from_database == from_cache
        assert_rebuilt_from(from_database, raw, thread_id, "turn 3")
        assert cache.get(count_key) == b"2:6"  # refilled from the database

        before = lookups(cache_server)
        reply = raw.ok([user("turn 3")], head)
        assert lookups(cache_server) - before == Counter(hit=1)
        assert backend.requests()[-1].body == from_cache
        assert reply["content"] == echo("turn 3")
        assert cache.get(count_key) == b"2:8"
        assert len(raw.export(thread_id)["messages"]) == 8
    finally:
        cache.close()
        raw.close()


def test_redis_killed_then_restarted_threads_keep_working(
    cache_server: ServerProcess, redis_up: PrivateRedis, backend: FakeBackend
) -> None:
    raw = RawClient(cache_server.url, new_key())
    try:
        replies = build_thread(raw, "killed")
        thread_id = thread_of_response(replies[0]["id"])
        assert thread_id is not None
        head = replies[-1]["id"]
        assert readyz(cache_server) == (
            200,
            {"status": "ready", "database": "ok", "cache": "ok", "cache_kind": "redis"},
        )
        from_cache = scripted_failure_body(backend, raw, head, "while down")

        redis_up.kill()
        # Redis is optional for serving: the database decides readiness, a cache outage is "degraded".
        status, body = readyz(cache_server)
        assert (status, body["status"], body["database"], body["cache"]) == (200, "degraded", "ok", "unavailable")

        before = lookups(cache_server)
        assert scripted_failure_body(backend, raw, head, "while down") == from_cache
        durations = []
        started = time.monotonic()
        down_reply = raw.ok([user("while down")], head)
        durations.append(time.monotonic() - started)
        assert backend.requests()[-1].body == from_cache
        started = time.monotonic()
        streamed = raw.turn([user("streamed while down")], down_reply["id"], stream=True)
        durations.append(time.monotonic() - started)
        assert streamed.status_code == 200
        events = sse_data(streamed.content)
        assert events[-1] == {"type": "message_stop"}
        started = time.monotonic()
        other = raw.ok([user("a new thread while down")], system=SYSTEM)
        durations.append(time.monotonic() - started)
        assert lookups(cache_server) - before == Counter(miss=3)  # the three continues, all from the database
        # Connection refused costs nothing like a timeout: every turn is served at once.
        assert max(durations) < 1.5, durations
        assert len(raw.export(thread_id)["messages"]) == 10
        assert raw.export(thread_of_response(other["id"]) or "")["messages"] == [
            user("a new thread while down"),
            {"role": "assistant", "content": echo("a new thread while down")},
        ]

        redis_up.start()  # same port, empty (no persistence)
        wait_for(lambda: readyz(cache_server)[1]["status"] == "ready", within=5, what="/readyz ready again")
        new_head = events[0]["message"]["id"]
        before = lookups(cache_server)
        rebuilt = scripted_failure_body(backend, raw, new_head, "after")
        assert_rebuilt_from(rebuilt, raw, thread_id, "after")
        raw.ok([user("after")], new_head)
        assert backend.requests()[-1].body == rebuilt
        assert lookups(cache_server) - before == Counter(miss=1, hit=1)
        with redis_up.client() as cache:
            assert cache.get(cache_keys(thread_id)[1]) == b"2:12"
    finally:
        raw.close()


def test_hung_redis_costs_time_not_turns(
    cache_server: ServerProcess, redis_up: PrivateRedis, backend: FakeBackend
) -> None:
    """SIGSTOP: connections stay open and nothing answers; every cache call waits out its socket timeout."""
    raw = RawClient(cache_server.url, new_key())
    try:
        replies = build_thread(raw, "hung")
        thread_id = thread_of_response(replies[0]["id"])
        assert thread_id is not None
        from_cache = scripted_failure_body(backend, raw, replies[-1]["id"], "while hung")

        redis_up.pause()
        try:
            started = time.monotonic()
            status, body = readyz(cache_server)
            readyz_seconds = time.monotonic() - started
            assert (status, body["status"], body["cache"]) == (200, "degraded", "unavailable")
            assert readyz_seconds < 2.0

            assert scripted_failure_body(backend, raw, replies[-1]["id"], "while hung") == from_cache
            started = time.monotonic()
            hung_reply = raw.ok([user("while hung")], replies[-1]["id"])
            hung_seconds = time.monotonic() - started
            assert backend.requests()[-1].body == from_cache
            # get, put, append (and the delete after a timed-out append): bounded by the 0.5 s socket timeouts.
            assert hung_seconds < 5.0, hung_seconds
            print(f"hung Redis: /readyz {readyz_seconds:.2f} s, a continue {hung_seconds:.2f} s")
        finally:
            redis_up.resume()

        # Whatever the late commands of the timed-out connections did to the entry, the rebuild is right.
        rebuilt = scripted_failure_body(backend, raw, hung_reply["id"], "after")
        assert_rebuilt_from(rebuilt, raw, thread_id, "after")
        raw.ok([user("after")], hung_reply["id"])
        assert backend.requests()[-1].body == rebuilt
        assert len(raw.export(thread_id)["messages"]) == 10
    finally:
        raw.close()


def test_evicted_entries_rebuild_the_same_bytes(
    cache_server: ServerProcess, redis_up: PrivateRedis, backend: FakeBackend
) -> None:
    """A small `maxmemory` with `allkeys-lru`: thread entries are evicted, wholly or one key of two, while in use."""
    raw = RawClient(cache_server.url, new_key())
    cache = redis_up.client()
    threads = 10
    try:
        # The budget is counted from a Redis that statestore already uses (its connections' buffers and its scripts
        # take about 200 KB beside the keys), so that it is the keys that do not fit; after the tests that took Redis
        # away, statestore's breaker may still be skipping it for a few seconds.
        wait_for(
            lambda: bool(build_thread(raw, "warm up", size=8_000, max_tokens=8_000)) and cache.dbsize() > 0,
            within=30,
            interval=0.5,
            what="statestore caching in Redis again",
        )
        cache.flushall()
        used = int(cache.info("memory")["used_memory"])
        cache.config_set("maxmemory-policy", "allkeys-lru")
        cache.config_set("maxmemory", used + 300_000)
        started = lookups(cache_server)
        heads = [build_thread(raw, f"evict {n}", size=8_000, max_tokens=8_000)[-1]["id"] for n in range(threads)]
        assert int(cache.info("stats")["evicted_keys"]) > 0  # 10 x 48 KB of history does not fit

        pairs = 0
        for n, head in enumerate(heads):
            thread_id = thread_of_response(head)
            assert thread_id is not None
            text = f"evict {n} last"
            first = scripted_failure_body(backend, raw, head, text, max_tokens=8_000)  # refills the entry
            again = scripted_failure_body(backend, raw, head, text, max_tokens=8_000)
            assert again == first
            # Push the entry out: 600 KB of other keys through a 300 KB budget.
            for i in range(12):
                cache.set(f"filler:{n}:{i}", b"f" * 50_000)
            joined_key, count_key = cache_keys(thread_id)
            pairs += cache.exists(joined_key, count_key) < 2
            assert_rebuilt_from(first, raw, thread_id, text)
            raw.ok([user(text)], head, max_tokens=8_000)
            assert backend.requests()[-1].body == first
        counted = lookups(cache_server) - started
        print(f"eviction: {pairs}/{threads} entries pushed out, lookups {dict(counted)}")
        assert pairs >= threads // 2, f"only {pairs} of {threads} entries were evicted by the filler"
        assert counted["hit"] >= threads and counted["miss"] >= threads, counted
        assert int(cache.info("stats")["evicted_keys"]) > threads
    finally:
        cache.close()
        raw.close()


def test_erasure_while_redis_is_down_leaves_no_history_in_redis(
    migrated_pg_url: str, fake_backend: FakeBackend
) -> None:
    """docs/protocol.md §7: DELETE erases "every byte of it, in the database and the cache". A Redis that persists (AOF)
    and is down during the erasure comes back with the thread's history unless statestore retries the deletion (or
    refuses the erasure)."""
    fake_backend.reset()
    with (
        private_redis(persistent=True) as store,
        running_server(
            database_url=migrated_pg_url, upstream_url=fake_backend.url, redis_url=store.url, redis_prefix=PREFIX
        ) as server,
    ):
        raw = RawClient(server.url, new_key())
        try:
            replies = build_thread(raw, "erase", turns=2)
            thread_id = thread_of_response(replies[0]["id"])
            assert thread_id is not None
            with store.client() as cache:
                assert cache.exists(*cache_keys(thread_id)) == 2
            store.kill()
            deleted = raw.http.delete(f"/statestore/v1/threads/{thread_id}")
            store.start()  # reloads the append-only file
            assert raw.http.get(f"/statestore/v1/threads/{thread_id}").status_code == 404
            if deleted.status_code == 200:
                with store.client() as cache:
                    # The erasure said it was done: give a retry a few seconds to catch up.
                    left = 2
                    deadline = time.monotonic() + 1.5
                    while left and time.monotonic() < deadline:
                        left = cache.exists(*cache_keys(thread_id))
                        time.sleep(0.1)
                    assert left == 0, f"the erased thread's history is still in Redis ({left} keys), for its TTL"
        finally:
            raw.close()


# == backend faults ==================================================================================================
# statestore whose backend read timeout is 1 s, on the shared PostgreSQL and Redis (its own key prefix).


@dataclass(frozen=True)
class Fault:
    action: dict[str, Any]
    status: int | None  # the HTTP status the client gets, or None for a stream that starts and never completes
    error_type: str | None
    ends_cleanly: bool = False  # the incomplete stream's body ends (with an `error` event) rather than breaking off


def _fault(action: dict[str, Any], stream: bool) -> Fault:
    """What docs/protocol.md §4 says the client gets for `action`, as JSON or as a stream."""
    if action["kind"] == "error":
        return Fault(action, action["status"], action["error"]["type"])
    if "error_after_events" in action:  # an `error` event mid-stream; as JSON, that error as an HTTP error
        return Fault(action, None, None, ends_cleanly=True) if stream else Fault(action, 529, action["error"]["type"])
    if action["kind"] == "close":
        return Fault(action, 502, "api_error")
    if action.get("delay_seconds"):  # no response headers within the read timeout
        return Fault(action, 504, "timeout_error")
    if stream:
        return Fault(action, None, None)  # the stream started; it must break off without message_stop
    if action.get("stall_seconds"):  # headers, then a body that does not come within the read timeout
        return Fault(action, 504, "timeout_error")
    return Fault(action, 502, "api_error")  # headers, then half a body and a closed connection


FAULT_ACTIONS: dict[str, dict[str, Any]] = {
    "429": error_action(429, "rate_limit_error", "Slow down", headers={"retry-after": "7"}),
    "500": error_action(500, "api_error", "Internal server error"),
    "529": error_action(529, "overloaded_error", "Overloaded"),
    "connection_closed": {"kind": "close"},
    "cut_after_3_events": {"kind": "echo", "cut_after_events": 3},
    "error_event_after_3_events": {
        "kind": "echo",
        "error_after_events": 3,
        "error": {"type": "overloaded_error", "message": "Overloaded"},
    },
    "stalled_past_read_timeout": {"kind": "echo", "stall_after_events": 3, "stall_seconds": STALL_SECONDS},
    "no_headers_within_read_timeout": {"kind": "echo", "delay_seconds": STALL_SECONDS},
}


@pytest.fixture(scope="module")
def shared_redis_prefix(redis_url: str) -> Iterator[str]:
    prefix = f"sstest:{secrets.token_hex(6)}:"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=prefix + "*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


FAULT_ENV = {"STATESTORE_UPSTREAM_READ_TIMEOUT": str(READ_TIMEOUT_SECONDS)}


@pytest.fixture(scope="module")
def fault_server(
    migrated_pg_url: str, redis_url: str, shared_redis_prefix: str, fake_backend: FakeBackend
) -> Iterator[ServerProcess]:
    with running_server(
        database_url=migrated_pg_url,
        upstream_url=fake_backend.url,
        redis_url=redis_url,
        redis_prefix=shared_redis_prefix,
        env=FAULT_ENV,
    ) as server:
        yield server


def thread_row(database_url: str, thread_id: str) -> tuple[str | None, int, str | None]:
    """head_message_id, head_position, lease_token."""
    [row] = query(
        database_url,
        "SELECT head_message_id, head_position, lease_token FROM threads WHERE id = :id",
        {"id": thread_id},
    )
    return row[0], int(row[1]), row[2]


def read_stream(response: httpx.Response) -> tuple[list[dict[str, Any]], bool]:
    """The events of a streamed response read to its end, and whether the body broke off."""
    data = b""
    try:
        for chunk in response.iter_raw():
            data += chunk
    except httpx.HTTPError:
        return sse_data(data), True
    return sse_data(data), False


def assert_fault_outcome(response: httpx.Response, fault: Fault, stream: bool) -> None:
    if fault.status is None:
        assert response.status_code == 200
        events, broken = read_stream(response)
        assert events[0]["type"] == "message_start"
        assert {"type": "message_stop"} not in events
        if fault.ends_cleanly:
            assert (events[-1]["type"], broken) == ("error", False)  # relayed as the backend sent it
        else:
            assert broken, "a stream the backend did not finish must not end cleanly"
        return
    body = response.read()
    assert (response.status_code, orjson.loads(body)["error"]["type"]) == (fault.status, fault.error_type), body
    assert "statestore-thread-id" not in response.headers
    assert response.headers.get("request-id")
    if fault.action["kind"] == "error":
        assert orjson.loads(body)["error"]["message"] == fault.action["error"]["message"]  # relayed unchanged
        for name, value in fault.action.get("headers", {}).items():
            assert response.headers.get(name) == value


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("kind", list(FAULT_ACTIONS))
def test_backend_fault_stores_nothing_and_the_id_stays_continuable(
    kind: str, stream: bool, fault_server: ServerProcess, backend: FakeBackend, migrated_pg_url: str
) -> None:
    raw = RawClient(fault_server.url, new_key())
    try:
        first = raw.ok([user("one")], system=SYSTEM)
        second = raw.ok([user("two")], first["id"])
        thread_id = thread_of_response(second["id"])
        assert thread_id is not None
        fault = _fault(FAULT_ACTIONS[kind], stream)
        backend.script(fault.action)

        started = time.monotonic()
        body = orjson.dumps(raw.body([user("lost")], second["id"], stream=stream))
        with raw.http.stream("POST", "/v1/messages", content=body) as response:
            assert_fault_outcome(response, fault, stream)
        elapsed = time.monotonic() - started
        assert elapsed < STALL_SECONDS, f"the fault took {elapsed:.2f} s: the read timeout is {READ_TIMEOUT_SECONDS} s"

        # Nothing stored, the head given back at once.
        assert thread_row(migrated_pg_url, thread_id) == (second["id"], 4, None)
        reply = raw.ok([user("three")], second["id"], stream=False)
        assert reply["content"] == echo("three")
        sent = backend.requests()[-1].json()
        assert sent["system"] == SYSTEM
        assert sent["messages"] == [
            user("one"),
            {"role": "assistant", "content": echo("one")},
            user("two"),
            {"role": "assistant", "content": echo("two")},
            user("three"),
        ]
        assert len(raw.export(thread_id)["messages"]) == 6
    finally:
        raw.close()


def test_backend_cut_during_a_create_stores_no_thread(
    fault_server: ServerProcess, backend: FakeBackend, migrated_pg_url: str
) -> None:
    raw = RawClient(fault_server.url, new_key())
    try:
        backend.script({"kind": "echo", "cut_after_events": 4})
        body = orjson.dumps(raw.body([user("never stored")], stream=True))
        with raw.http.stream("POST", "/v1/messages", content=body) as response:
            events, broken = read_stream(response)
        assert broken
        minted = events[0]["message"]["id"]
        thread_id = thread_of_response(minted)
        assert thread_id is not None
        assert scalar(migrated_pg_url, "SELECT count(*) FROM threads WHERE id = :id", {"id": thread_id}) == 0
        refused = raw.turn([user("again")], minted)
        assert (refused.status_code, error_of(refused)["details"]["error_code"]) == (404, "thread_not_found")
    finally:
        raw.close()


def test_client_leaving_mid_stream_gives_the_head_back(
    fault_server: ServerProcess, backend: FakeBackend, migrated_pg_url: str
) -> None:
    raw = RawClient(fault_server.url, new_key())
    try:
        first = raw.ok([user("one")])
        thread_id = thread_of_response(first["id"])
        assert thread_id is not None
        # The backend sends message_start, ping, content_block_start, then nothing for 2.5 s (the read timeout is
        # 1 s): the client leaves while statestore waits on the backend.
        backend.script({"kind": "echo", "stall_after_events": 3, "stall_seconds": STALL_SECONDS})
        body = orjson.dumps(raw.body([user("left")], first["id"], stream=True))
        with raw.http.stream("POST", "/v1/messages", content=body) as response:
            assert response.status_code == 200
            next(response.iter_raw())
            left_at = time.monotonic()
        released = wait_for(
            lambda: thread_row(migrated_pg_url, thread_id)[2] is None, within=3, what="the lease given back"
        )
        assert time.monotonic() - left_at < READ_TIMEOUT_SECONDS + 1.0, (
            f"released {released:.2f} s after the client left"
        )
        print(f"client left mid-stream: head given back {released:.2f} s later")
        assert thread_row(migrated_pg_url, thread_id)[:2] == (first["id"], 2)
        raw.ok([user("back")], first["id"])
        assert backend.requests()[-1].json()["messages"] == [
            user("one"),
            {"role": "assistant", "content": echo("one")},
            user("back"),
        ]
    finally:
        raw.close()


def test_backend_refusing_connections_is_502_and_stores_nothing(
    migrated_pg_url: str, redis_url: str, shared_redis_prefix: str, fault_server: ServerProcess, backend: FakeBackend
) -> None:
    """A second statestore on the same database and cache whose backend port is closed."""
    raw = RawClient(fault_server.url, new_key())
    try:
        first = raw.ok([user("one")], system=SYSTEM)
        thread_id = thread_of_response(first["id"])
        assert thread_id is not None
        with running_server(
            database_url=migrated_pg_url,
            upstream_url=f"http://127.0.0.1:{free_port()}",
            redis_url=redis_url,
            redis_prefix=shared_redis_prefix,
            env=FAULT_ENV,
        ) as closed:
            stranded = RawClient(closed.url, raw.api_key)
            try:
                outcomes: Counter[tuple[int, str]] = Counter()
                for stream in (False, True, False, True):
                    for previous in (first["id"], None):
                        started = time.monotonic()
                        response = stranded.turn([user("unreachable")], previous, stream=stream)
                        assert time.monotonic() - started < 2.0
                        outcomes[(response.status_code, error_of(response)["type"])] += 1
                assert outcomes == Counter({(502, "api_error"): 8})
            finally:
                stranded.close()
        assert thread_row(migrated_pg_url, thread_id) == (first["id"], 2, None)
        raw.ok([user("two")], first["id"])
        assert backend.requests()[-1].json()["messages"] == [
            user("one"),
            {"role": "assistant", "content": echo("one")},
            user("two"),
        ]
    finally:
        raw.close()


# == 1,000 faulty turns, and nothing leaks ===========================================================================

SLOTS = 40  # threads, and requests per batch
BATCHES = 25  # 1,000 faulty requests
LEAK_KINDS = [
    "429",
    "500",
    "529",
    "connection_closed",
    "cut_after_3_events",
    "error_event_after_3_events",
    "stalled_past_read_timeout",
    "no_headers_within_read_timeout",
]


@dataclass(frozen=True)
class Planned:
    slot: int
    create: bool
    stream: bool
    leave_early: bool  # the client disconnects after the first bytes of the stream


def _plan() -> list[Planned]:
    plans = []
    for slot in range(SLOTS):
        stream = slot % 2 == 1
        plans.append(Planned(slot, create=slot % 5 == 0, stream=stream, leave_early=stream and slot % 4 == 3))
    return plans


def _run_one(http: httpx.Client, plan: Planned, head: str, batch: int) -> str:
    """One request; what the client saw: "ok" (a whole reply), "status <n>", "incomplete" (a stream without
    message_stop) or "left"."""
    body = RawClient.body([user(f"fault {batch}/{plan.slot}")], None if plan.create else head, stream=plan.stream)
    with http.stream("POST", "/v1/messages", content=orjson.dumps(body)) as response:
        if response.status_code != 200:
            response.read()
            return f"status {response.status_code}"
        if not plan.stream:
            response.read()
            return "ok"
        if plan.leave_early:
            next(response.iter_raw())
            return "left"
        events, broken = read_stream(response)
        return "ok" if {"type": "message_stop"} in events and not broken else "incomplete"


def _expected_outcome(kind: str, plan: Planned) -> str:
    fault = _fault(FAULT_ACTIONS[kind], plan.stream)
    if fault.status is not None:
        return f"status {fault.status}"
    return "left" if plan.leave_early else "incomplete"


def _status_class(outcome: str) -> str:
    return f"status {outcome[7]}xx" if outcome.startswith("status ") else outcome


def _create(http: httpx.Client, text: str) -> dict[str, Any]:
    response = http.post("/v1/messages", content=orjson.dumps(RawClient.body([user(text)])))
    assert response.status_code == 200, response.text
    reply: dict[str, Any] = response.json()
    return reply


def _settled_descriptors(server: ServerProcess, peers: dict[int, str]) -> Counter[str]:
    """The server's open descriptors by kind once they stop changing (closed client connections take a moment)."""
    last: Counter[str] = Counter()
    for _ in range(40):
        now = open_descriptors(server.pid, serving_port=server.port, peers=peers)
        if now == last and not now["client"]:
            break
        last = now
        time.sleep(0.1)
    return last


# The pools of a process with database_pool_size 10, no overflow: transactions 10, single statements 10 // 4,
# prepared turns 10 and leases 10 // 2 (docs/deployment.md's connection budget).
POOL_BUDGET = 10 + 2 + 10 + 5


def _assert_no_descriptor_leak(before: Counter[str], after: Counter[str]) -> None:
    """Files and pipes as before; connections within what the pools may hold at the test's concurrency (a leak of
    one a failed turn would be hundreds)."""
    assert set(after) <= {"other", "socket", "listen", "client", "backend", "redis", "postgres"}, after
    assert after["other"] <= before["other"] + 2 and after["socket"] <= before["socket"] + 2, (before, after)
    assert (after["listen"], after["client"]) == (1, 0), after
    assert after["backend"] <= SLOTS and after["redis"] <= max(before["redis"], SLOTS), (before, after)
    assert after["postgres"] <= POOL_BUDGET, after


def test_a_thousand_faulty_turns_leak_nothing(
    fresh_pg_url: str, redis_url: str, redis_prefix: str, fake_backend: FakeBackend
) -> None:
    upgrade(fresh_pg_url)
    fake_backend.reset()
    # The default lease (120 s) so that a lease left held shows up here rather than running out.
    with running_server(
        database_url=fresh_pg_url,
        upstream_url=fake_backend.url,
        redis_url=redis_url,
        redis_prefix=redis_prefix,
        env=FAULT_ENV,
    ) as server:
        api_key = new_key()
        limits = httpx.Limits(max_connections=2 * SLOTS, max_keepalive_connections=2 * SLOTS)
        headers = {"x-api-key": api_key, "anthropic-beta": THREADS_BETA, "content-type": "application/json"}

        def client() -> httpx.Client:
            return httpx.Client(base_url=server.url, headers=headers, timeout=15, limits=limits)

        with client() as http, ThreadPoolExecutor(SLOTS) as pool:
            # Warm up every pool (database, Redis, backend connections) at the concurrency of the test.
            created = list(pool.map(lambda n: _create(http, f"slot {n}"), range(SLOTS)))
            warm = list(
                pool.map(
                    lambda n: _run_one(http, Planned(n, False, n % 2 == 1, False), created[n]["id"], -1), range(SLOTS)
                )
            )
            assert warm == ["ok"] * SLOTS
        heads = {row[0]: row[1] for row in query(fresh_pg_url, "SELECT id, head_message_id FROM threads")}
        assert len(heads) == SLOTS
        head_of_slot = [heads[thread_of_response(reply["id"]) or ""] for reply in created]
        peers = {
            urlsplit(fake_backend.url).port or 0: "backend",
            urlsplit(redis_url).port or 6379: "redis",
            make_url(fresh_pg_url).port or 5432: "postgres",
        }
        fds_before = _settled_descriptors(server, peers)
        connections_before = statestore_connections(fresh_pg_url)
        stored_before = metric(server, "thread_turns_total", kind="continue", outcome="stored") + metric(
            server, "thread_turns_total", kind="create", outcome="stored"
        )
        not_stored_before = metric(server, "thread_turns_total", kind="continue", outcome="not_stored") + metric(
            server, "thread_turns_total", kind="create", outcome="not_stored"
        )

        outcomes: Counter[str] = Counter()
        by_kind: dict[str, Counter[str]] = {}
        started = time.monotonic()
        with client() as http, ThreadPoolExecutor(SLOTS) as pool:
            for batch in range(BATCHES):
                kind = LEAK_KINDS[batch % len(LEAK_KINDS)]
                fake_backend.script(*[FAULT_ACTIONS[kind]] * SLOTS)
                plans = _plan()
                seen = list(
                    pool.map(_run_one, [http] * SLOTS, plans, [head_of_slot[p.slot] for p in plans], [batch] * SLOTS)
                )
                outcomes.update(seen)
                by_kind.setdefault(kind, Counter()).update(seen)
                # Every request reached the backend, and every head is free again before the next batch.
                wait_for(lambda: fake_backend.pending() == 0, within=5, what=f"batch {batch} ({kind}) consumed")
                wait_for(lambda: held_leases(fresh_pg_url) == 0, within=5, what=f"leases after batch {batch} ({kind})")
        faults_seconds = time.monotonic() - started

        assert sum(outcomes.values()) == SLOTS * BATCHES == 1000
        assert outcomes["ok"] == 0, by_kind
        # What each client saw, by fault; statuses by class (which 5xx a JSON turn gets is the per-fault test's).
        expected: dict[str, Counter[str]] = {}
        for batch in range(BATCHES):
            kind = LEAK_KINDS[batch % len(LEAK_KINDS)]
            expected.setdefault(kind, Counter()).update(_expected_outcome(kind, plan) for plan in _plan())
        assert {kind: Counter(map(_status_class, seen)) for kind, seen in by_kind.items()} == {
            kind: Counter(map(_status_class, seen)) for kind, seen in expected.items()
        }
        assert len(fake_backend.requests()) == 2 * SLOTS + 1000
        stored_after = metric(server, "thread_turns_total", kind="continue", outcome="stored") + metric(
            server, "thread_turns_total", kind="create", outcome="stored"
        )
        not_stored_after = metric(server, "thread_turns_total", kind="continue", outcome="not_stored") + metric(
            server, "thread_turns_total", kind="create", outcome="not_stored"
        )
        assert (stored_after - stored_before, not_stored_after - not_stored_before) == (0, 1000)

        # Nothing stored: the same threads, heads and messages; no thread left by a failed create.
        assert held_leases(fresh_pg_url) == 0
        assert {row[0]: row[1] for row in query(fresh_pg_url, "SELECT id, head_message_id FROM threads")} == heads
        threads = stored_threads(fresh_pg_url)
        assert sum(len(t.messages) for t in threads.values()) == 4 * SLOTS

        # No descriptor or database connection kept by a failed turn.
        fds_after = _settled_descriptors(server, peers)
        connections_after = statestore_connections(fresh_pg_url)
        _assert_no_descriptor_leak(fds_before, fds_after)
        # Pools open connections lazily, so more load may open more of them, never past the budget.
        assert sum(connections_after.values()) <= POOL_BUDGET, (
            connections_before,
            connections_after,
        )
        assert set(connections_after) <= {"idle"}, connections_after

        # The server still answers normally, every id continuing with its full history.
        fake_backend.reset()
        with client() as http, ThreadPoolExecutor(SLOTS) as pool:
            final = list(
                pool.map(
                    lambda n: _run_one(http, Planned(n, False, n % 2 == 1, False), head_of_slot[n], 99), range(SLOTS)
                )
            )
        assert final == ["ok"] * SLOTS
        sent = sorted((r.json()["messages"] for r in fake_backend.requests()), key=lambda m: m[0]["content"])
        assert sent == sorted(
            (
                [
                    user(f"slot {n}"),
                    {"role": "assistant", "content": echo(f"slot {n}")},
                    user(f"fault -1/{n}"),
                    {"role": "assistant", "content": echo(f"fault -1/{n}")},
                    user(f"fault 99/{n}"),
                ]
                for n in range(SLOTS)
            ),
            key=lambda m: m[0]["content"],
        )
        fds_final = _settled_descriptors(server, peers)
        _assert_no_descriptor_leak(fds_before, fds_final)
        assert held_leases(fresh_pg_url) == 0
        print(f"1000 faulty turns in {faults_seconds:.1f} s; outcomes {dict(outcomes)}; by kind {by_kind}")
        print(f"descriptors {dict(fds_before)} -> {dict(fds_after)} -> {dict(fds_final)}")
        print(f"database connections {connections_before} -> {connections_after}")
