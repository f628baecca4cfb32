"""The Alembic revisions against real PostgreSQL and SQLite: they build exactly schema.py, and undo it."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection

from statestore.store import migrate
from statestore.store.engine import SQLITE_BUSY_TIMEOUT_MS, create_engine
from statestore.store.schema import metadata, sessions, thread_messages, threads

REPO_ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ["postgresql", "sqlite"]


@pytest.fixture(params=BACKENDS)
def fresh_url(request: pytest.FixtureRequest) -> str:
    fixture = "fresh_pg_url" if request.param == "postgresql" else "fresh_sqlite_url"
    url: str = request.getfixturevalue(fixture)
    return url


@pytest.fixture(params=BACKENDS)
def migrated_url(request: pytest.FixtureRequest) -> str:
    fixture = "migrated_pg_url" if request.param == "postgresql" else "migrated_sqlite_url"
    url: str = request.getfixturevalue(fixture)
    return url


# A comparable description of a schema: per table its columns (nullability), primary key, indexes, unique
# constraints and foreign keys, all with their names. Server defaults and types are left to `alembic check`.
Shape = dict[str, dict[str, Any]]


def expected_shape() -> Shape:
    shape: Shape = {}
    for table in metadata.sorted_tables:
        shape[table.name] = {
            "columns": {column.name: column.nullable for column in table.columns},
            "pk": (table.primary_key.name, [column.name for column in table.primary_key.columns]),
            "indexes": {index.name: [column.name for column in index.columns] for index in table.indexes},
            "uniques": {
                constraint.name: [column.name for column in constraint.columns]
                for constraint in table.constraints
                if isinstance(constraint, sa.UniqueConstraint)
            },
            "fks": {
                fk.name: ([column.name for column in fk.columns], fk.referred_table.name, fk.ondelete)
                for fk in table.foreign_key_constraints
            },
        }
    return shape


def reflected_shape(connection: Connection) -> Shape:
    inspector = sa.inspect(connection)
    shape: Shape = {}
    for name in inspector.get_table_names():
        if name == "alembic_version":
            continue
        pk = inspector.get_pk_constraint(name)
        shape[name] = {
            "columns": {column["name"]: column["nullable"] for column in inspector.get_columns(name)},
            "pk": (pk["name"], pk["constrained_columns"]),
            "indexes": {
                index["name"]: index["column_names"]
                for index in inspector.get_indexes(name)
                # PostgreSQL lists the index behind each unique constraint too; those are compared as constraints.
                if not index.get("duplicates_constraint")
            },
            "uniques": {unique["name"]: unique["column_names"] for unique in inspector.get_unique_constraints(name)},
            "fks": {
                fk["name"]: (fk["constrained_columns"], fk["referred_table"], fk["options"].get("ondelete"))
                for fk in inspector.get_foreign_keys(name)
            },
        }
    return shape


async def table_names(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        async with engine.connect() as connection:
            return set(await connection.run_sync(lambda sync: sa.inspect(sync).get_table_names()))
    finally:
        await engine.dispose()


async def shape_of(url: str) -> Shape:
    engine = create_engine(url)
    try:
        async with engine.connect() as connection:
            return await connection.run_sync(reflected_shape)
    finally:
        await engine.dispose()


async def test_upgrade_builds_the_metadata_and_downgrade_removes_it(fresh_url: str) -> None:
    await asyncio.to_thread(migrate.upgrade, fresh_url)
    assert await shape_of(fresh_url) == expected_shape()

    await asyncio.to_thread(migrate.downgrade, fresh_url, "base")
    # Alembic keeps its (now empty) version table; everything of statestore is gone.
    assert await table_names(fresh_url) == {"alembic_version"}

    await asyncio.to_thread(migrate.upgrade, fresh_url)
    assert await shape_of(fresh_url) == expected_shape()


async def test_alembic_check_finds_no_drift_at_head(fresh_url: str) -> None:
    await asyncio.to_thread(migrate.upgrade, fresh_url)
    # Raises when autogenerate would emit anything: types, server defaults, indexes, constraints included.
    await asyncio.to_thread(command.check, migrate.alembic_config(fresh_url))


async def test_pending_revision_says_what_is_missing(fresh_url: str) -> None:
    engine = create_engine(fresh_url)
    try:
        empty = await migrate.pending_revision(engine)
        assert empty is not None
        assert "no statestore schema" in empty

        await asyncio.to_thread(migrate.upgrade, fresh_url)
        assert await migrate.pending_revision(engine) is None

        async with engine.begin() as connection:
            await connection.execute(sa.text("UPDATE alembic_version SET version_num = 'f00dfeed'"))
        newer = await migrate.pending_revision(engine)
        assert newer is not None
        assert "f00dfeed" in newer
        assert "newer statestore" in newer
        # A rolling upgrade or a rollback: older code runs on a newer (additive) schema when allowed.
        assert await migrate.pending_revision(engine, allow_newer=True) is None
    finally:
        await engine.dispose()


async def test_upgrade_called_inside_a_running_loop(fresh_sqlite_url: str) -> None:
    # The sync API must not trip over the caller's loop (env.py runs one of its own).
    migrate.upgrade(fresh_sqlite_url)
    assert "threads" in await table_names(fresh_sqlite_url)


async def test_deleting_a_thread_cascades(migrated_url: str) -> None:
    engine = create_engine(migrated_url)
    thread_id = f"thr_{os.urandom(8).hex()}"
    try:
        async with engine.begin() as connection:
            await connection.execute(
                threads.insert().values(
                    id=thread_id, owner="owner", ttl_seconds=300, created_ms=1, updated_ms=1, expires_ms=2
                )
            )
            await connection.execute(
                thread_messages.insert(),
                [{"thread_id": thread_id, "position": position, "body": b"{}"} for position in range(3)],
            )
            await connection.execute(
                sessions.insert().values(owner="owner", name=thread_id, thread_id=thread_id, updated_ms=1)
            )
        async with engine.begin() as connection:
            await connection.execute(threads.delete().where(threads.c.id == thread_id))
        async with engine.connect() as connection:
            messages = await connection.scalar(
                sa.select(sa.func.count()).where(thread_messages.c.thread_id == thread_id)
            )
            bindings = await connection.scalar(sa.select(sa.func.count()).where(sessions.c.thread_id == thread_id))
        assert (messages, bindings) == (0, 0)
    finally:
        await engine.dispose()


async def test_sqlite_connections_get_their_pragmas(migrated_sqlite_url: str) -> None:
    engine = create_engine(migrated_sqlite_url)
    try:
        async with engine.connect() as connection:
            values = [
                (await connection.exec_driver_sql(f"PRAGMA {pragma}")).scalar()
                for pragma in ("foreign_keys", "journal_mode", "synchronous", "busy_timeout")
            ]
        assert values == [1, "wal", 2, SQLITE_BUSY_TIMEOUT_MS]  # synchronous=FULL is 2
    finally:
        await engine.dispose()


async def test_postgres_connections_name_the_application(migrated_pg_url: str) -> None:
    engine = create_engine(migrated_pg_url)
    try:
        async with engine.connect() as connection:
            assert await connection.scalar(sa.text("SELECT current_setting('application_name')")) == "statestore"
    finally:
        await engine.dispose()


async def test_the_callers_url_wins_over_the_environment(
    fresh_sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    elsewhere = tmp_path / "elsewhere.db"
    monkeypatch.setenv("STATESTORE_DATABASE_URL", f"sqlite:///{elsewhere}")
    await asyncio.to_thread(migrate.upgrade, fresh_sqlite_url)
    assert "threads" in await table_names(fresh_sqlite_url)
    assert not elsewhere.exists()


def test_alembic_command_line_uses_the_environment_url(tmp_path: Path) -> None:
    database = tmp_path / "cli.db"
    # The plain sqlite:/// scheme, as a developer would write it: normalised the way Settings does.
    environment = {**os.environ, "STATESTORE_DATABASE_URL": f"sqlite:///{database}"}
    environment.pop(migrate.MIGRATIONS_DIR_ENV, None)
    result = subprocess.run(
        [sys.executable, "-m", "alembic", "-c", str(REPO_ROOT / "alembic.ini"), "upgrade", "head"],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert database.exists()
    assert not (tmp_path / "statestore.db").exists()


def test_migrate_says_whether_it_created_moved_or_found_nothing_to_do(tmp_path: Path) -> None:
    database = tmp_path / "fresh.db"
    environment = {**os.environ, "STATESTORE_DATABASE_URL": f"sqlite:///{database}"}
    environment.pop(migrate.MIGRATIONS_DIR_ENV, None)

    def statestore_migrate() -> str:
        result = subprocess.run(
            [sys.executable, "-m", "statestore.cli", "migrate"],
            cwd=tmp_path,
            env=environment,
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    assert f"created the schema at revision {CODE_HEAD}" in statestore_migrate()
    assert f"database already at revision {CODE_HEAD}, nothing to do" in statestore_migrate()
    migrate.downgrade(f"sqlite+aiosqlite:///{database}", "0006")
    assert f"migrated the database from revision 0006 to {CODE_HEAD}" in statestore_migrate()


# The newest revision the code ships; the test revisions below stack on it.
CODE_HEAD = ScriptDirectory.from_config(migrate.alembic_config("sqlite+aiosqlite://")).get_current_head() or ""


# A later revision that rebuilds the parent table the way batch mode does on SQLite (copy, DROP, rename).
REBUILD_THREADS = textwrap.dedent(
    '''
    """Rebuild threads."""

    import sqlalchemy as sa
    from alembic import op

    revision = "9001"
    down_revision = "HEAD"
    branch_labels = None
    depends_on = None


    def upgrade() -> None:
        with op.batch_alter_table("threads", recreate="always") as batch:
            batch.add_column(sa.Column("extra", sa.Integer(), nullable=True))


    def downgrade() -> None:
        with op.batch_alter_table("threads", recreate="always") as batch:
            batch.drop_column("extra")
    '''
)


async def test_sqlite_table_rebuild_keeps_child_rows(
    fresh_sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With foreign keys on during a migration, the DROP of the rebuild would cascade-delete every message.
    migrations = tmp_path / "migrations"
    shutil.copytree(migrate.migrations_dir(), migrations, ignore=shutil.ignore_patterns("__pycache__"))
    (migrations / "versions" / "9001_rebuild_threads.py").write_text(REBUILD_THREADS.replace("HEAD", CODE_HEAD))
    monkeypatch.setenv(migrate.MIGRATIONS_DIR_ENV, str(migrations))

    await asyncio.to_thread(migrate.upgrade, fresh_sqlite_url, CODE_HEAD)
    engine = create_engine(fresh_sqlite_url)
    try:
        async with engine.begin() as connection:
            await connection.execute(
                threads.insert().values(id="thr_1", owner="o", ttl_seconds=1, created_ms=1, updated_ms=1, expires_ms=1)
            )
            await connection.execute(thread_messages.insert().values(thread_id="thr_1", position=0, body=b"{}"))

        await asyncio.to_thread(migrate.upgrade, fresh_sqlite_url)
        await asyncio.to_thread(migrate.downgrade, fresh_sqlite_url, CODE_HEAD)

        async with engine.connect() as connection:
            assert await connection.scalar(sa.select(sa.func.count()).select_from(thread_messages)) == 1
            assert (await connection.exec_driver_sql("PRAGMA foreign_key_check")).fetchall() == []
    finally:
        await engine.dispose()


FAILING_REVISION = textwrap.dedent(
    '''
    """Create a table, then fail."""

    import sqlalchemy as sa
    from alembic import op

    revision = "9002"
    down_revision = "HEAD"
    branch_labels = None
    depends_on = None


    def upgrade() -> None:
        op.create_table("half_done", sa.Column("id", sa.Integer(), primary_key=True))
        raise RuntimeError("revision failed")


    def downgrade() -> None:
        op.drop_table("half_done")
    '''
)


async def test_a_failed_revision_leaves_nothing_behind(
    fresh_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # PostgreSQL has transactional DDL; on SQLite env.py issues the BEGIN the driver would not.
    migrations = tmp_path / "migrations"
    shutil.copytree(migrate.migrations_dir(), migrations, ignore=shutil.ignore_patterns("__pycache__"))
    (migrations / "versions" / "9002_failing.py").write_text(FAILING_REVISION.replace("HEAD", CODE_HEAD))
    monkeypatch.setenv(migrate.MIGRATIONS_DIR_ENV, str(migrations))

    await asyncio.to_thread(migrate.upgrade, fresh_url, CODE_HEAD)
    with pytest.raises(RuntimeError, match="revision failed"):
        await asyncio.to_thread(migrate.upgrade, fresh_url)
    assert "half_done" not in await table_names(fresh_url)
    engine = create_engine(fresh_url)
    try:
        async with engine.connect() as connection:
            assert await connection.scalar(sa.text("SELECT version_num FROM alembic_version")) == CODE_HEAD
    finally:
        await engine.dispose()
