"""The async engine: one a process, built here for PostgreSQL (asyncpg) or the embedded SQLite (aiosqlite)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import asyncpg
from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DataError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from statestore.config import Settings

DEFAULT_POOL_SIZE = 10

# What a database outage looks like from here: SQLAlchemy's errors, asyncpg's own (the hot path's statements run on
# it directly), and the OSError (a refused connection) and TimeoutError (a hung server) that reach us unwrapped.
DATABASE_ERRORS: tuple[type[BaseException], ...] = (
    SQLAlchemyError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    OSError,
    TimeoutError,
)
# A value the database cannot hold or compare (a NUL in text, a number out of range): the request's fault.
UNSTORABLE_VALUE_ERRORS: tuple[type[Exception], ...] = (DataError, asyncpg.DataError)

# How long a SQLite connection waits for another connection's write lock before "database is locked".
SQLITE_BUSY_TIMEOUT_MS = 5_000

# Per-connection settings (journal_mode is stored in the file, repeating it is harmless and covers new files).
# WAL lets readers run while one connection writes. synchronous=FULL because a turn the client has seen the end of
# must survive a power loss too (docs/guarantees.md, invariant 1). SQLite leaves foreign keys off unless asked, and the
# schema relies on ON DELETE CASCADE.
_SQLITE_PRAGMAS = (
    "PRAGMA foreign_keys=ON",
    "PRAGMA journal_mode=WAL",
    "PRAGMA synchronous=FULL",
    f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}",
)


def normalise_database_url(url: str) -> str:
    """The async-driver form of a database URL (``postgresql://`` → ``postgresql+asyncpg://``, …)."""
    # The very rule Settings applies, so the CLI, alembic on the command line and the server agree.
    return Settings._async_driver(url)


def create_engine(
    settings_or_url: Settings | str,
    *,
    pool_size: int | None = None,
    timeout: float | None = None,
    autocommit: bool = False,
) -> AsyncEngine:
    """Build the engine. ``pool_size`` defaults to ``Settings.database_pool_size`` (or 10 for a bare URL), ``timeout``
    (PostgreSQL: connect, statement and pool-checkout bound) to ``Settings.database_timeout_seconds`` (or 5 s)."""
    if isinstance(settings_or_url, Settings):
        url = settings_or_url.database_url
        size = pool_size or settings_or_url.database_pool_size
        bound = timeout or settings_or_url.database_timeout_seconds
    else:
        url = normalise_database_url(settings_or_url)
        size = pool_size or DEFAULT_POOL_SIZE
        bound = timeout or DEFAULT_TIMEOUT_SECONDS
    # autocommit: an engine of its own for single statements, so a checkout does not switch isolation levels.
    options: dict[str, Any] = {"isolation_level": "AUTOCOMMIT"} if autocommit else {}
    if url.startswith("sqlite"):
        return _sqlite_engine(url, size, options)
    return _postgres_engine(url, size, bound, options)


DEFAULT_TIMEOUT_SECONDS = 5.0


def _postgres_engine(url: str, pool_size: int, timeout: float, options: dict[str, Any]) -> AsyncEngine:
    return create_async_engine(
        url,
        pool_size=pool_size,
        # No overflow: pool_size is then a hard cap on connections per process, which is what an operator sizes
        # PostgreSQL's max_connections against.
        max_overflow=0,
        # A pre-ping is a round trip on every checkout of the hot path; recycling old connections covers most
        # server-side idle disconnects instead, and a dead connection fails one request and is discarded.
        pool_pre_ping=False,
        pool_recycle=1800,
        # A hung database must fail requests within a bound (503), not hold them: connect and statement timeouts,
        # and a bounded wait for a pooled connection.
        pool_timeout=timeout,
        connect_args={
            "server_settings": {"application_name": "statestore"},
            "timeout": timeout,
            "command_timeout": timeout,
        },
        **options,
    )


def _sqlite_engine(url: str, pool_size: int, extra: dict[str, Any]) -> AsyncEngine:
    # An in-memory database lives on a single shared connection (SQLAlchemy picks StaticPool), which takes no size.
    options: dict[str, Any] = {} if _is_in_memory(url) else {"pool_size": pool_size}
    engine = create_async_engine(url, **options, **extra)
    event.listen(engine.sync_engine, "connect", _apply_sqlite_pragmas)
    return engine


def _apply_sqlite_pragmas(dbapi_connection: Any, _connection_record: Any) -> None:
    cursor = dbapi_connection.cursor()
    try:
        for pragma in _SQLITE_PRAGMAS:
            cursor.execute(pragma)
    finally:
        cursor.close()


def missing_sqlite_database(url: str) -> str | None:
    """For a SQLite file that does not exist yet, what to tell the operator; else None. SQLite would create an empty
    file on first connect, and every command but `migrate` must not: it would fail later, on a missing schema, with
    an empty file left behind wherever it happened to run."""
    url = normalise_database_url(url)
    if not url.startswith("sqlite") or _is_in_memory(url):
        return None
    path = Path(make_url(url).database or "").expanduser().resolve()
    if path.exists():
        return None
    return (
        f"no SQLite database at {path} (from STATESTORE_DATABASE_URL, or the default sqlite:///./statestore.db in "
        f"the working directory). Create it with `statestore migrate`, or point STATESTORE_DATABASE_URL at yours."
    )


def _is_in_memory(url: str) -> bool:
    parsed = make_url(url)
    return parsed.database in (None, "", ":memory:") or parsed.query.get("mode") == "memory"
