"""Schema changes on PostgreSQL while the release before serves (a rolling upgrade), for the migrations in
migrations/versions/.

Each step runs in a transaction of its own (autocommit), so the migration holds one table's lock at a time and only
for a moment: in one transaction, its lock on one table and its wait for another's deadlock with serving commits that
write both (found by the rolling-upgrade drill, twice). A step waits at most `LOCK_TIMEOUT_MS` for its lock, so the
serving statements queued behind it wait no longer, then gives way and is tried again. Every step must be safe to run
again (`IF NOT EXISTS`): a migration cut short is run again from the start."""

from __future__ import annotations

import time
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

LOCK_TIMEOUT_MS = 1000
ATTEMPTS = 30


def run_online(steps: Sequence[list[str]]) -> None:
    """Each step (a list of its statements, in order) in an autocommit block, retried on a lock timeout or a
    deadlock."""
    with op.get_context().autocommit_block():
        bind = op.get_bind()
        bind.exec_driver_sql(f"SET lock_timeout = {LOCK_TIMEOUT_MS}")
        for step in steps:
            for attempt in range(1, ATTEMPTS + 1):
                try:
                    for statement in step:
                        bind.exec_driver_sql(statement)
                    break
                except sa.exc.DBAPIError as error:
                    if attempt == ATTEMPTS or not ("lock timeout" in str(error) or "deadlock" in str(error)):
                        raise
                    time.sleep(0.1 * attempt)
        bind.exec_driver_sql("RESET lock_timeout")
