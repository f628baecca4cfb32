"""Leases outlive neither a crashed request nor a live one: a reply that takes longer than the lease keeps its
thread head (the lease is renewed while it runs), and the turn commits."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.integration.test_threads import RawThreads, ok, sse_events, thread_error, user
from tests.support.fake_backend import FakeBackend
from tests.support.server import StatestoreServer

LEASE_SECONDS = 1


@pytest.fixture(scope="module")
def short_lease_server(
    migrated_pg_url: str, redis_url: str, server_redis_prefix: str, fake_backend_process: FakeBackend
) -> Iterator[StatestoreServer]:
    server = StatestoreServer(
        database_url=migrated_pg_url,
        upstream_url=fake_backend_process.url,
        redis_url=redis_url,
        redis_prefix=server_redis_prefix,
        env={"STATESTORE_LEASE_SECONDS": str(LEASE_SECONDS)},
    )
    yield server
    server.stop()


def test_a_stream_longer_than_the_lease_keeps_the_head_and_commits(
    short_lease_server: StatestoreServer, backend: FakeBackend, api_key: str
) -> None:
    raw = RawThreads(short_lease_server.url, api_key)
    try:
        head = ok(raw.create([user("one")]))["id"]
        # The reply stalls for three lease lengths after its first events.
        backend.script({"kind": "echo", "stall_after_events": 3, "stall_seconds": 3 * LEASE_SECONDS})
        result: dict[str, httpx.Response] = {}

        def stream() -> None:
            result["stream"] = raw.continue_(head, [user("two")], stream=True)

        runner = threading.Thread(target=stream)
        runner.start()
        time.sleep(2 * LEASE_SECONDS)  # past the lease the turn started with
        rival = raw.continue_(head, [user("rival")])
        thread_error(rival, 400, "thread_continue_in_flight")
        runner.join(timeout=20)

        events = [event["type"] for event in sse_events(result["stream"])]
        assert events[-1] == "message_stop"
        thread_id = result["stream"].headers["statestore-thread-id"]
        assert raw.info(thread_id)["message_count"] == 4  # one, its reply, two, its reply
        assert len(backend.requests()) == 2  # the rival never reached the backend
    finally:
        raw.close()
