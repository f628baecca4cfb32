"""The daily_usage row each stored turn adds to, in the turn's own transaction (the console's charts, GET
/admin/v1/usage): its key, and the Core statement for SQLite and PostgreSQL's cold paths. PostgreSQL's one-statement
commits (store/thread_commit.py, store/response_statements.py) embed the same upsert as a CTE; it conflicts on
(day, shard) alone, since a shard belongs to one door."""

from __future__ import annotations

import zlib

from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.sql.dml import Insert

from statestore.doors import DOORS, Door
from statestore.store.schema import daily_usage

DAY_MS = 86_400_000
# Rows a day's usage is spread over, per door: concurrent commits on PostgreSQL would otherwise all wait on one row's
# lock.
USAGE_SHARDS = 16


def usage_key(door: Door, now_ms: int, spread_by: str) -> tuple[int, int]:
    """The (UTC day, shard) a turn adds to. Each door counts on shards of its own, so the primary key stays (day,
    shard) for code from before the door column (revision 0009); within a door the shard is chosen by `spread_by`, a
    thread or conversation, whose turns never run concurrently and so can share a row."""
    return now_ms // DAY_MS, DOORS.index(door) * USAGE_SHARDS + zlib.crc32(spread_by.encode()) % USAGE_SHARDS


def count_usage(*, is_postgres: bool, door: Door, day: int, shard: int, added_bytes: int) -> Insert:
    """The upsert of one stored turn into its day's row (`usage_key`), for a Core transaction."""
    dialect_insert = postgresql.insert if is_postgres else sqlite.insert
    stmt = dialect_insert(daily_usage).values(day=day, shard=shard, door=door, turns=1, bytes=added_bytes)
    return stmt.on_conflict_do_update(
        index_elements=[daily_usage.c.day, daily_usage.c.shard],
        set_={"turns": daily_usage.c.turns + 1, "bytes": daily_usage.c.bytes + stmt.excluded.bytes},
    )
