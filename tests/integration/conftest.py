"""Real processes for integration tests: the scriptable fake backend and statestore servers on PostgreSQL + Redis
and on the embedded default (SQLite, in-process cache)."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anthropic
import pytest

from tests.support import tls
from tests.support.admin_api import ClockFile
from tests.support.fake_backend import FakeBackend
from tests.support.redis_keys import own_redis_prefix
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


@pytest.fixture(scope="session")
def server_redis_prefix(redis_url: str) -> Iterator[str]:
    with own_redis_prefix(redis_url) as prefix:
        yield prefix


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
    http = anthropic.DefaultHttpxClient(verify=tls.CONTEXT)
    with anthropic.Anthropic(base_url=pg_server.url, api_key=api_key, max_retries=0, http_client=http) as sdk:
        yield sdk


# -- message threads (tests/integration/test_threads*.py) ------------------------------------------------------------


@pytest.fixture
def server_client(server: StatestoreServer, api_key: str) -> Iterator[anthropic.Anthropic]:
    """The official SDK against `server`, so a test that takes it runs on both storage set-ups."""
    http = anthropic.DefaultHttpxClient(verify=tls.CONTEXT)
    with anthropic.Anthropic(base_url=server.url, api_key=api_key, max_retries=0, http_client=http) as sdk:
        yield sdk


@pytest.fixture(scope="session")
async def private_pg_url(postgres_admin_url: str) -> AsyncIterator[str]:
    """A migrated database for the dedicated servers below, whose retention policy comes from their settings: a
    default policy stored in the shared database (by an admin API test, say) would take precedence there."""
    from tests.conftest import migrated_scratch_pg_database

    async with migrated_scratch_pg_database(postgres_admin_url) as url:
        yield url


@pytest.fixture(params=["postgres", "sqlite"])
async def scratch_database_url(
    request: pytest.FixtureRequest, postgres_admin_url: str, migrated_sqlite_url: str
) -> AsyncIterator[str]:
    """A migrated database of the test's own on PostgreSQL, and the session's migrated SQLite file."""
    from tests.conftest import migrated_scratch_pg_database

    if request.param == "postgres":
        async with migrated_scratch_pg_database(postgres_admin_url) as url:
            yield url
    else:
        yield migrated_sqlite_url


def _dedicated_server(
    database_url: str, redis_url: str, prefix: str, backend: FakeBackend, env: dict[str, str]
) -> StatestoreServer:
    return StatestoreServer(
        database_url=database_url, upstream_url=backend.url, redis_url=redis_url, redis_prefix=prefix, env=env
    )


@pytest.fixture(scope="session")
def clock_offset_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Seconds added to the clock of `clock_server`: a test moves that server's time forward by writing it (see
    `advance_clock` in test_threads.py), so expiry is tested without sleeping."""
    return tmp_path_factory.mktemp("clock") / "offset-seconds"


@pytest.fixture(scope="session")
def clock_server(
    private_pg_url: str,
    redis_url: str,
    server_redis_prefix: str,
    fake_backend_process: FakeBackend,
    clock_offset_file: Path,
) -> Iterator[StatestoreServer]:
    """statestore on PostgreSQL and Redis whose threads live 60 seconds by default and at most 300, on a clock the
    tests move forward; started by the first test that asks for it and shared from then on."""
    server = _dedicated_server(
        private_pg_url,
        redis_url,
        server_redis_prefix,
        fake_backend_process,
        {
            "STATESTORE_DEFAULT_TTL_SECONDS": "60",
            "STATESTORE_MAX_TTL_SECONDS": "300",
            "STATESTORE_CLOCK_OFFSET_FILE": str(clock_offset_file),
        },
    )
    yield server
    server.stop()


@pytest.fixture(scope="session")
def threads_off_server(
    private_pg_url: str, redis_url: str, server_redis_prefix: str, fake_backend_process: FakeBackend
) -> Iterator[StatestoreServer]:
    """statestore with threads turned off by its retention policy."""
    server = _dedicated_server(
        private_pg_url, redis_url, server_redis_prefix, fake_backend_process, {"STATESTORE_THREADS_ENABLED": "false"}
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
async def module_db(postgres_admin_url: str) -> AsyncIterator[str]:
    """A migrated PostgreSQL database of the test module's own (its servers' state is the module's alone)."""
    from tests.support.admin_api import migrated_database

    async with migrated_database(postgres_admin_url) as url:
        yield url


@pytest.fixture(scope="module")
def module_prefix(redis_url: str) -> Iterator[str]:
    """A Redis key prefix of the test module's own."""
    with own_redis_prefix(redis_url) as value:
        yield value


@pytest.fixture(scope="module")
def clock(tmp_path_factory: pytest.TempPathFactory) -> ClockFile:
    """A clock file a module's servers read (STATESTORE_CLOCK_OFFSET_FILE) and its tests move forward."""
    return ClockFile(tmp_path_factory.mktemp("clock") / "offset")
