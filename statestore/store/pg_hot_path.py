"""PostgreSQL's hot path below SQLAlchemy: the statements every turn runs (store/lease_statements.py and its family), as
asyncpg prepared statements, each bound from its typed parameter object (store/statement.py).

SQLAlchemy Core keeps the schema, the migrations, SQLite and every cold path; these few statements are the ones a
turn cannot avoid, and SQLAlchemy's execution layers cost more CPU than the statements themselves (bench/README.md).

One pool, its connections told apart by durability (store/pg_pool.py). Taking, renewing and giving back a lease
commit asynchronously (`synchronous_commit = off`): a lease lost in a crash is harmless, because the turn's commit
checks the lease token, and a lease the database forgets only frees the log sooner. The turn's commit waits for its
WAL flush as usual, so a turn the client has seen the end of is durable (docs/guarantees.md, invariant 1): one
durable flush per turn.
"""

from __future__ import annotations

from typing import Any

import asyncpg
from sqlalchemy.engine import make_url

from statestore.config import Settings
from statestore.store.pg_pool import LeanPool
from statestore.store.statement import P, PgStatement


def asyncpg_dsn(sqlalchemy_url: str) -> str:
    return make_url(sqlalchemy_url).set(drivername="postgresql").render_as_string(hide_password=False)


class PgHotPath:
    """The pool and the four ways of running a statement on it; asyncpg prepares each statement once per connection
    and reuses it (its statement cache)."""

    def __init__(self, pool: LeanPool) -> None:
        self._pool = pool

    @classmethod
    async def open(cls, settings: Settings) -> PgHotPath | None:
        """The pool, or None when the database is not PostgreSQL. Connections are made on first use."""
        if not settings.database_url.startswith("postgresql"):
            return None
        # The bounds mirror the engine's: a hung database fails a turn within the timeout (503), it never holds it.
        # STATESTORE_DATABASE_POOL_SIZE connections for the hot statements, the leases' and the commits' together.
        pool = LeanPool(
            asyncpg_dsn(settings.database_url),
            max_size=settings.database_pool_size,
            timeout=settings.database_timeout_seconds,
            server_settings={"application_name": "statestore"},
        )
        return cls(pool)

    async def aclose(self) -> None:
        await self._pool.close()

    async def execute(self, statement: PgStatement[P], params: P) -> str:
        """The command's status (`UPDATE 1`)."""
        async with self._pool.acquire(durable=statement.durable) as conn:
            status: str = await conn.execute(statement.sql, *statement.bind(params))
        return status

    async def fetchval(self, statement: PgStatement[P], params: P) -> Any:
        async with self._pool.acquire(durable=statement.durable) as conn:
            return await conn.fetchval(statement.sql, *statement.bind(params))

    async def fetchrow(self, statement: PgStatement[P], params: P) -> asyncpg.Record | None:
        async with self._pool.acquire(durable=statement.durable) as conn:
            row: asyncpg.Record | None = await conn.fetchrow(statement.sql, *statement.bind(params))
        return row

    async def fetch(self, statement: PgStatement[P], params: P) -> list[asyncpg.Record]:
        async with self._pool.acquire(durable=statement.durable) as conn:
            rows: list[asyncpg.Record] = await conn.fetch(statement.sql, *statement.bind(params))
        return rows


def affected(status: str) -> int:
    """The row count of a command's status (`INSERT 0 3` → 3)."""
    return int(status.rsplit(" ", 1)[-1])
