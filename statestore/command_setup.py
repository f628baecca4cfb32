"""What every `statestore` command starts from (statestore/cli.py, statestore/admin_cli.py,
statestore/encryption/commands.py): the settings, read or refused with a message that names each bad one; the
database, required to exist; and a database URL as a message may show it."""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic import ValidationError

from statestore.config import Settings


def load_settings() -> Settings:
    try:
        return Settings()
    except ValidationError as exc:
        lines = [f"  STATESTORE_{'_'.join(str(p) for p in err['loc']).upper()}: {err['msg']}" for err in exc.errors()]
        sys.exit("statestore: invalid settings:\n" + "\n".join(lines))


def require_database(settings: Settings) -> None:
    from statestore.store.engine import missing_sqlite_database

    if (problem := missing_sqlite_database(settings.database_url)) is not None:
        sys.exit(f"statestore: {problem}")


def safe_url(url: str) -> str:
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.drivername.startswith("sqlite") and parsed.database not in (None, "", ":memory:"):
        return f"SQLite file {Path(parsed.database).expanduser().resolve()}"
    return parsed.render_as_string(hide_password=True)
