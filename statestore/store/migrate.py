"""Schema migrations: run the Alembic revisions in ``migrations/``, and tell whether a database is at their head."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from statestore.store.engine import create_engine, normalise_database_url

MIGRATIONS_DIR_ENV = "STATESTORE_MIGRATIONS_DIR"

# Marks a Config whose URL the caller chose, so env.py does not swap in STATESTORE_DATABASE_URL: a test migrating
# its own scratch database must never migrate the one the environment points at.
EXPLICIT_URL_ATTRIBUTE = "statestore.explicit_url"

log = logging.getLogger(__name__)


def migrations_dir() -> Path:
    """The Alembic scripts: shipped in the package as statestore.migrations (repository folder migrations/, mapped in
    by setup.py), unless STATESTORE_MIGRATIONS_DIR names another folder."""
    override = os.environ.get(MIGRATIONS_DIR_ENV)
    if override:
        path = Path(override)
        if not (path / "env.py").is_file():
            raise FileNotFoundError(
                f"no Alembic migrations at {path} (from {MIGRATIONS_DIR_ENV}); unset it to use "
                "the ones statestore ships"
            )
        return path
    shipped = resources.files("statestore.migrations")
    if not isinstance(shipped, Path) or not (shipped / "env.py").is_file():
        # Alembic reads scripts from a folder: a zipped install cannot migrate from inside the archive.
        raise FileNotFoundError(f"the shipped migrations are not a folder ({shipped}); set {MIGRATIONS_DIR_ENV}")
    return shipped


def alembic_config(database_url: str) -> Config:
    """An Alembic config for ``database_url``, independent of any alembic.ini (and of its logging setup)."""
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    # Config is a ConfigParser, which would read a '%' of a percent-encoded password as interpolation.
    config.set_main_option("sqlalchemy.url", normalise_database_url(database_url).replace("%", "%%"))
    config.attributes[EXPLICIT_URL_ATTRIBUTE] = True
    return config


@dataclass(frozen=True, slots=True)
class Migrated:
    """The revisions a database was at before and after `upgrade` (empty: no statestore schema)."""

    before: frozenset[str]
    after: frozenset[str]

    def describe(self) -> str:
        """What the migration did, for the operator: created, moved, or found nothing to do."""
        if self.before == self.after:
            return f"database already at revision {_revisions(self.after)}, nothing to do"
        if not self.before:
            return f"created the schema at revision {_revisions(self.after)}"
        return f"migrated the database from revision {_revisions(self.before)} to {_revisions(self.after)}"


def upgrade(database_url: str, revision: str = "head") -> Migrated:
    config = alembic_config(database_url)
    found: list[frozenset[str]] = []

    def work() -> None:
        found.append(_heads_of(config))
        command.upgrade(config, revision)
        found.append(_heads_of(config))

    _outside_event_loop(work)
    return Migrated(before=found[0], after=found[1])


def _heads_of(config: Config) -> frozenset[str]:
    # The revisions stamped in the database, read through the same async engine env.py uses.
    async def read() -> frozenset[str]:
        engine = create_engine(config.get_main_option("sqlalchemy.url") or "", pool_size=1)
        try:
            async with engine.connect() as connection:
                return frozenset(await connection.run_sync(_current_heads))
        finally:
            await engine.dispose()

    return asyncio.run(read())


def downgrade(database_url: str, revision: str) -> None:
    _outside_event_loop(lambda: command.downgrade(alembic_config(database_url), revision))


async def pending_revision(engine: AsyncEngine, *, allow_newer: bool = False) -> str | None:
    """None when the database is at the code's head revision, else what is wrong, for a startup refusal.

    With `allow_newer`, a schema migrated by a newer statestore (a revision this code does not know) is accepted with
    a warning: migrations are additive, so during a rolling upgrade or a rollback the older code keeps working."""
    script = _script_directory()
    expected = set(script.get_heads())
    async with engine.connect() as connection:
        current = set(await connection.run_sync(_current_heads))
    if current == expected:
        return None
    # Callers add their own remedy ("run `statestore migrate`"), so these only describe.
    if not current:
        return "database has no statestore schema"
    described = f"database is at revision {_revisions(current)}, code expects {_revisions(expected)}"
    known = {revision.revision for revision in script.walk_revisions()}
    if not current <= known:
        if allow_newer:
            log.warning("the database schema is newer than this code; running on it", extra={"schema": described})
            return None
        return described + " (a revision this code does not know: migrated by a newer statestore?)"
    return described


def _script_directory() -> ScriptDirectory:
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    return ScriptDirectory.from_config(config)


def _current_heads(connection: Connection) -> tuple[str, ...]:
    return MigrationContext.configure(connection).get_current_heads()


def _revisions(revisions: set[str] | frozenset[str]) -> str:
    return ", ".join(sorted(revisions))


def _outside_event_loop(work: Callable[[], None]) -> None:
    # env.py drives the async engine with asyncio.run(), which refuses to start inside a running loop; an async
    # caller (a lifespan, a test) gets a thread of its own. That blocks its loop for the duration, so async code
    # should prefer `await asyncio.to_thread(upgrade, url)`.
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        work()
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="statestore-migrate") as pool:
        pool.submit(work).result()
