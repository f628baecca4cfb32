"""The daily_usage row each stored turn adds to, in the turn's own transaction (the console's charts, GET
/admin/v1/usage): its key, and its upsert, written once for both databases. PostgreSQL's one-statement commits
(store/thread_commit.py, store/response_commit.py) embed the upsert as a CTE; it conflicts on (day, shard) alone,
since a shard belongs to one door."""

from __future__ import annotations

import zlib
from typing import Any

from sqlalchemy import literal_column, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.sql.dml import Insert
from sqlalchemy.sql.elements import ColumnClause
from sqlalchemy.sql.selectable import FromClause

from statestore.doors import DOORS, Door
from statestore.store.schema import daily_usage

DAY_MS = 86_400_000
# Rows a day's usage is spread over, per door: concurrent commits on PostgreSQL would otherwise all wait on one row's
# lock.
USAGE_SHARDS = 16
_ONE: ColumnClause[Any] = literal_column("1")


def usage_key(door: Door, now_ms: int, spread_by: str) -> tuple[int, int]:
    """The (UTC day, shard) a turn adds to. Each door counts on shards of its own, so the primary key stays (day,
    shard) for code from before the door column (revision 0009); within a door the shard is chosen by `spread_by`, a
    thread or conversation, whose turns never run concurrently and so can share a row."""
    return now_ms // DAY_MS, DOORS.index(door) * USAGE_SHARDS + zlib.crc32(spread_by.encode()) % USAGE_SHARDS


def count_usage(
    *, postgres: bool, door: Door, day: Any, shard: Any, added_bytes: Any, after: FromClause | None = None
) -> Insert:
    """The upsert of one stored turn into its day's row (`usage_key`); `day`, `shard` and `added_bytes` are values or
    bind parameters. `after`: a PostgreSQL commit's first step (a CTE), the row counted only if it stored the turn."""
    dialect_insert = postgresql.insert if postgres else sqlite.insert
    # The door is the schema's name, never a request's value.
    door_sql: ColumnClause[Any] = literal_column(f"'{door}'")
    if after is None:
        stmt = dialect_insert(daily_usage).values(day=day, shard=shard, door=door_sql, turns=_ONE, bytes=added_bytes)
    else:
        stmt = dialect_insert(daily_usage).from_select(
            ["day", "shard", "door", "turns", "bytes"],
            select(day, shard, door_sql, _ONE, added_bytes).select_from(after),
        )
    return stmt.on_conflict_do_update(
        index_elements=[daily_usage.c.day, daily_usage.c.shard],
        set_={"turns": daily_usage.c.turns + _ONE, "bytes": daily_usage.c.bytes + stmt.excluded.bytes},
    )
