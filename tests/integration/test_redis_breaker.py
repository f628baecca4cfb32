"""A black-holed Redis (it accepts connections and never answers) costs a turn one timeout at most now and then, not one
per cache operation: after a failure the cache is skipped for a back-off period (statestore/retry_policy.py) and turns
are served from the database."""

from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Iterator

import pytest

from tests.integration.test_threads import RawThreads, ok, user
from tests.support.fake_backend import FakeBackend
from tests.support.server import StatestoreServer


@pytest.fixture(scope="module")
def black_hole() -> Iterator[str]:
    """A Redis URL whose port completes TCP handshakes (the kernel's backlog) and never reads or answers."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(512)
    yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
    listener.close()


@pytest.fixture(scope="module")
def black_holed_server(
    module_db: str, black_hole: str, server_redis_prefix: str, fake_backend_process: FakeBackend
) -> Iterator[StatestoreServer]:
    server = StatestoreServer(
        database_url=module_db,
        upstream_url=fake_backend_process.url,
        redis_url=black_hole,
        redis_prefix=server_redis_prefix,
    )
    yield server
    server.stop()


def test_a_black_holed_redis_costs_a_turn_no_timeout_per_cache_operation(
    black_holed_server: StatestoreServer, api_key: str
) -> None:
    raw = RawThreads(black_holed_server.url, api_key)
    try:
        head = ok(raw.create([user("one")]))["id"]
        took = []
        for n in range(8):
            started = time.monotonic()
            head = ok(raw.continue_(head, [user(f"turn {n}")]))["id"]
            took.append(time.monotonic() - started)
        # Each cache operation that waits on the black hole costs its timeout (0.5 s), and a continue makes three or
        # four (claim, read, append); skipped, a turn costs what the database does. A probe now and then may wait.
        assert statistics.median(took) < 0.4, took
        assert sum(took) < 3.0, took
    finally:
        raw.http.close()
