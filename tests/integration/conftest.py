"""Real processes for integration tests: the scriptable fake backend and statestore servers on PostgreSQL + Redis
and on the embedded default (SQLite, in-process cache)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import anthropic
import pytest
import redis

from tests.support.fake_backend import FakeBackend
from tests.support.server import StatestoreServer


@pytest.fixture(scope="session")
def fake_backend_process() -> Iterator[FakeBackend]:
    with FakeBackend() as backend:
        yield backend


@pytest.fixture
def backend(fake_backend_process: FakeBackend) -> FakeBackend:
    """The fake backend with an empty script and no recorded requests."""
    fake_backend_process.reset()
    return fake_backend_process


def _drop_prefix(redis_url: str, prefix: str) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=prefix.replace("{", "\\{") + "*", count=1000))
        for key in keys:
            client.delete(key)
    finally:
        client.close()


@pytest.fixture(scope="session")
def server_redis_prefix(redis_url: str) -> Iterator[str]:
    prefix = f"sstest:{secrets.token_hex(6)}:"
    yield prefix
    _drop_prefix(redis_url, prefix)


@pytest.fixture(scope="session")
def pg_server(
    migrated_pg_url: str, redis_url: str, server_redis_prefix: str, fake_backend_process: FakeBackend
) -> Iterator[StatestoreServer]:
    """statestore on PostgreSQL and Redis, shared by the session: tests make their own threads."""
    server = StatestoreServer(
        database_url=migrated_pg_url,
        upstream_url=fake_backend_process.url,
        redis_url=redis_url,
        redis_prefix=server_redis_prefix,
    )
    yield server
    server.stop()


@pytest.fixture(scope="session")
def sqlite_server(
    tmp_path_factory: pytest.TempPathFactory, fake_backend_process: FakeBackend
) -> Iterator[StatestoreServer]:
    """statestore on the embedded default: a SQLite file and the in-process cache."""
    from statestore.store.migrate import upgrade

    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('sqlite') / 'statestore.db'}"
    upgrade(url)
    server = StatestoreServer(database_url=url, upstream_url=fake_backend_process.url)
    yield server
    server.stop()


@pytest.fixture(params=["postgres", "sqlite"])
def server(request: pytest.FixtureRequest) -> StatestoreServer:
    """Each test that takes it runs on both storage set-ups."""
    name = "pg_server" if request.param == "postgres" else "sqlite_server"
    value: StatestoreServer = request.getfixturevalue(name)
    return value


@pytest.fixture
def api_key() -> str:
    """A credential of its own per test, so each test is its own owner."""
    return f"sk-test-{secrets.token_hex(8)}"


@pytest.fixture
def client(pg_server: StatestoreServer, api_key: str) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=pg_server.url, api_key=api_key, max_retries=0) as sdk:
        yield sdk
