"""Alembic environment: runs the revisions on the same async engine statestore serves with.

Two ways in: ``statestore.store.migrate`` builds the config itself and names the database; ``alembic`` on the
command line reads alembic.ini, where STATESTORE_DATABASE_URL (when set) wins over its SQLite default, so a
developer migrates the database the server would use.
"""

from __future__ import annotations

import asyncio
import os
from logging.config import fileConfig
from typing import Any

from alembic import context
from sqlalchemy import event
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from statestore.store.engine import create_engine, normalise_database_url
from statestore.store.migrate import EXPLICIT_URL_ATTRIBUTE
from statestore.store.schema import metadata

config = context.config
target_metadata = metadata

if config.config_file_name is not None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def database_url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    if not config.attributes.get(EXPLICIT_URL_ATTRIBUTE):
        url = os.environ.get("STATESTORE_DATABASE_URL") or url
    if not url:
        raise RuntimeError("no database URL: set STATESTORE_DATABASE_URL or sqlalchemy.url in alembic.ini")
    return normalise_database_url(url)


def configure(**options: Any) -> None:
    sqlite = database_url().startswith("sqlite")
    context.configure(
        target_metadata=target_metadata,
        # SQLite can only add columns in place; batch mode rebuilds the table for every other ALTER.
        render_as_batch=sqlite,
        # SQLite does run DDL in transactions once we issue BEGIN ourselves (see make_sqlite_transactional), so a
        # failed revision leaves nothing half done there either.
        transactional_ddl=True,
        # PostgreSQL: each revision commits on its own, so the locks one takes (an ADD COLUMN's ACCESS EXCLUSIVE) are
        # held for that revision only, never across the whole chain while the release before serves on (a rolling
        # upgrade from several revisions back saw a 503 while 0009-0017 ran in one transaction).
        transaction_per_migration=not sqlite,
        compare_type=True,
        compare_server_default=True,
        **options,
    )


def run_migrations_offline() -> None:
    configure(url=database_url(), literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def do_run_migrations(connection: Connection) -> None:
    configure(connection=connection)
    with context.begin_transaction():
        context.run_migrations()
        if connection.dialect.name == "sqlite":
            check_sqlite_foreign_keys(connection)


async def run_async_migrations() -> None:
    engine = create_engine(database_url(), pool_size=1)
    if engine.dialect.name == "sqlite":
        make_sqlite_transactional(engine)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(do_run_migrations)
    finally:
        await engine.dispose()


def make_sqlite_transactional(engine: AsyncEngine) -> None:
    """Prepare the migration engine's SQLite connections (its own engine: the server's are left alone)."""

    @event.listens_for(engine.sync_engine, "connect")
    def on_connect(dbapi_connection: Any, _connection_record: Any) -> None:
        # Batch mode rebuilds a table by copy, DROP and rename; with foreign keys on, that DROP would cascade-delete
        # every child row. The PRAGMA is ignored inside a transaction, hence here, before any BEGIN.
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA foreign_keys=OFF")
        cursor.close()
        # The driver's legacy mode commits DDL statement by statement; take over BEGIN instead.
        dbapi_connection.isolation_level = None

    @event.listens_for(engine.sync_engine, "begin")
    def on_begin(connection: Connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")


def check_sqlite_foreign_keys(connection: Connection) -> None:
    # Foreign keys were off while the revisions ran: refuse to commit a schema whose rows no longer match it.
    violations = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
    if violations:
        raise RuntimeError(f"migration left rows violating foreign keys (table, rowid, parent, fk): {violations[:10]}")


if context.is_offline_mode():
    run_migrations_offline()
else:
    asyncio.run(run_async_migrations())
