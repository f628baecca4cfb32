"""Fixtures shared by the whole suite: real PostgreSQL and Redis (never mocks), scratch databases, Redis key prefixes.

Services are found through the environment, and `make test` starts both:

- ``STATESTORE_TEST_PG``: an admin URL allowed to CREATE/DROP DATABASE (default
  ``postgresql://postgres@127.0.0.1:5432/postgres``);
- ``STATESTORE_TEST_REDIS`` (default ``redis://127.0.0.1:6379/0``).

A test that needs a service that is down fails; it is never skipped, or a broken CI would look green.

- ``postgres_admin_url`` (session): the admin URL, as ``postgresql+asyncpg://``, once PostgreSQL answered.
- ``redis_url`` (session): the Redis URL, once Redis answered PING.
- ``fresh_pg_url`` (function): ``postgresql+asyncpg://`` URL of a new, empty database; dropped afterwards.
- ``migrated_pg_url`` (session): ``postgresql+asyncpg://`` URL of one database at head, SHARED by the whole
  session: tests using it create their own rows (random ids) and never expect empty tables.
- ``fresh_sqlite_url`` (function): ``sqlite+aiosqlite://`` URL of a file in ``tmp_path`` that does not exist yet.
- ``migrated_sqlite_url`` (function): ``sqlite+aiosqlite://`` URL of a database at head, this test's own copy.
- ``redis_prefix`` (function): ``sstest:<hex>:``; every key under it is deleted after the test (SCAN + DEL).

Migrations run in a worker thread (``asyncio.to_thread``): Alembic's env.py starts its own event loop, and the
test's loop must keep running meanwhile. On PostgreSQL they run once per process, into a template database that each
migrated database is then copied from.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import NoReturn

import pytest
import redis.asyncio as redis
from redis.exceptions import RedisError
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from statestore.store.migrate import upgrade

DEFAULT_TEST_PG = "postgresql://postgres@127.0.0.1:5432/postgres"
DEFAULT_TEST_REDIS = "redis://127.0.0.1:6379/0"
CONNECT_TIMEOUT_SECONDS = 5.0


# `make test` runs the suite on two pytest-xdist workers (--dist loadfile: a module runs whole on one worker, so its
# module-scoped servers start once). The slowest folders are handed out first, so neither worker is left with a long
# one at the end.
_FIRST = ("upgrade", "campaign", "packaging", "realbackend", "scaleout", "reliability")


def _rank(item: pytest.Item) -> int:
    folder = Path(str(item.fspath)).resolve().relative_to(Path(__file__).resolve().parent).parts[0]
    return _FIRST.index(folder) if folder in _FIRST else len(_FIRST)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_rank)  # stable: within a module, the order of collection


def _service_unreachable(service: str, url: str, error: BaseException) -> NoReturn:
    shown = make_url(url).render_as_string(hide_password=True) if "://" in url else url
    if os.environ.get("CI"):
        hint = "the CI job must provide it (service container) before running the tests"
    else:
        hint = "run the tests with `make test`, which starts PostgreSQL and Redis"
    pytest.fail(f"{service} is not reachable at {shown} ({type(error).__name__}: {error}); {hint}", pytrace=False)


def _admin_engine(admin_url: str) -> AsyncEngine:
    # CREATE/DROP DATABASE refuse to run inside a transaction, hence AUTOCOMMIT.
    return create_async_engine(
        admin_url,
        isolation_level="AUTOCOMMIT",
        poolclass=NullPool,
        connect_args={"timeout": CONNECT_TIMEOUT_SECONDS},
    )


@pytest.fixture(scope="session")
async def postgres_admin_url() -> str:
    raw = os.environ.get("STATESTORE_TEST_PG") or DEFAULT_TEST_PG
    url = make_url(raw).set(drivername="postgresql+asyncpg").render_as_string(hide_password=False)
    engine = _admin_engine(url)
    failure: BaseException | None = None
    try:
        async with engine.connect() as connection:
            await connection.exec_driver_sql("SELECT 1")
    except (OSError, TimeoutError, SQLAlchemyError) as error:
        failure = error
    finally:
        await engine.dispose()
    if failure is not None:
        # Outside the except block, so the report is the one line above, not a chained traceback.
        _service_unreachable("PostgreSQL", url, failure)
    return url


@pytest.fixture(scope="session")
async def redis_url() -> str:
    url = os.environ.get("STATESTORE_TEST_REDIS") or DEFAULT_TEST_REDIS
    client = redis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_SECONDS)
    failure: BaseException | None = None
    try:
        await client.ping()
    except (OSError, RedisError) as error:
        failure = error
    finally:
        await client.aclose()
    if failure is not None:
        _service_unreachable("Redis", url, failure)
    return url


@asynccontextmanager
async def scratch_pg_database(admin_url: str, *, template: str | None = None) -> AsyncIterator[str]:
    """A new empty database (``statestore_test_<hex>``), or a copy of `template`, for the block; yields its asyncpg
    URL, then drops it.

    The fixtures below use it; call it directly when a test needs more than one database.
    """
    name = f"statestore_test_{secrets.token_hex(6)}"
    admin = _admin_engine(admin_url)
    try:
        async with admin.connect() as connection:
            copied = f' TEMPLATE "{template}"' if template is not None else ""
            await connection.exec_driver_sql(f'CREATE DATABASE "{name}"{copied}')
        try:
            yield make_url(admin_url).set(database=name).render_as_string(hide_password=False)
        finally:
            async with admin.connect() as connection:
                # FORCE: an engine the test forgot to dispose must not leave the database behind.
                await connection.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.dispose()


# The real migrations run once per process, into a template database; each migrated scratch database is a copy of it
# (CREATE DATABASE ... TEMPLATE), which takes a fraction of Alembic's time. Dropped when the session finishes.
_templates: dict[str, str] = {}
_templates_lock = threading.Lock()


def _migrated_template(admin_url: str) -> str:
    """The name of this process's migrated template database on that server, made the first time. Called in a worker
    thread: Alembic's env.py starts an event loop of its own, and so does the creation here."""
    with _templates_lock:
        if admin_url not in _templates:
            name = f"statestore_template_{secrets.token_hex(6)}"
            asyncio.run(_execute(admin_url, f'CREATE DATABASE "{name}"'))
            try:
                upgrade(make_url(admin_url).set(database=name).render_as_string(hide_password=False))
            except BaseException:
                asyncio.run(_execute(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
                raise
            _templates[admin_url] = name
        return _templates[admin_url]


async def _execute(admin_url: str, statement: str) -> None:
    admin = _admin_engine(admin_url)
    try:
        async with admin.connect() as connection:
            await connection.exec_driver_sql(statement)
    finally:
        await admin.dispose()


def pytest_sessionfinish() -> None:
    for admin_url, name in _templates.items():
        asyncio.run(_execute(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    _templates.clear()


@asynccontextmanager
async def migrated_scratch_pg_database(admin_url: str) -> AsyncIterator[str]:
    """A new database at head (a copy of one migrated by the real migrations) for the block; yields its asyncpg URL,
    then drops it."""
    template = await asyncio.to_thread(_migrated_template, admin_url)
    async with scratch_pg_database(admin_url, template=template) as url:
        yield url


@pytest.fixture
async def fresh_pg_url(postgres_admin_url: str) -> AsyncIterator[str]:
    async with scratch_pg_database(postgres_admin_url) as url:
        yield url


@pytest.fixture(scope="session")
async def migrated_pg_url(postgres_admin_url: str) -> AsyncIterator[str]:
    async with migrated_scratch_pg_database(postgres_admin_url) as url:
        yield url


def _sqlite_url(path: Path) -> str:
    return f"sqlite+aiosqlite:///{path}"


@pytest.fixture
def fresh_sqlite_url(tmp_path: Path) -> str:
    return _sqlite_url(tmp_path / "statestore.db")


@pytest.fixture(scope="session")
async def _migrated_sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Migrated once; each test gets a file copy, which is far cheaper than running Alembic again.
    path = tmp_path_factory.mktemp("sqlite-template") / "statestore.db"
    await asyncio.to_thread(upgrade, _sqlite_url(path))
    return path


@pytest.fixture
def migrated_sqlite_url(_migrated_sqlite_template: Path, tmp_path: Path) -> str:
    path = tmp_path / "statestore.db"
    shutil.copyfile(_migrated_sqlite_template, path)
    # WAL mode: anything not yet checkpointed into the main file lives in the -wal file.
    wal = _migrated_sqlite_template.with_name(_migrated_sqlite_template.name + "-wal")
    if wal.exists():
        shutil.copyfile(wal, path.with_name(path.name + "-wal"))
    return _sqlite_url(path)


@pytest.fixture
async def redis_prefix(redis_url: str) -> AsyncIterator[str]:
    prefix = f"sstest:{secrets.token_hex(8)}:"
    yield prefix
    # Only this test's keys: the Redis may be shared with other runs, or with a developer's own data.
    client = redis.Redis.from_url(redis_url)
    try:
        keys = [key async for key in client.scan_iter(match=prefix + "*", count=1000)]
        for start in range(0, len(keys), 1000):
            await client.delete(*keys[start : start + 1000])
    finally:
        await client.aclose()
