"""PostgreSQL's hot path below SQLAlchemy: the statements every turn runs, as asyncpg prepared statements.

SQLAlchemy Core keeps the schema, the migrations, SQLite and every cold path; these few statements are the ones a
turn cannot avoid, and SQLAlchemy's execution layers cost more CPU than the statements themselves (bench/README.md).

Two pools, told apart by durability. Taking, renewing and giving back a lease commit asynchronously
(`synchronous_commit = off`): a lease lost in a crash is harmless, because the turn's commit checks the lease token,
and a lease the database forgets only frees the thread sooner. The turn's commit waits for its WAL flush as usual,
so a turn the client has seen the end of is durable (invariant 1): one durable flush per turn.
"""

from __future__ import annotations

from typing import Any

import asyncpg
from sqlalchemy.engine import make_url

from statestore.config import Settings
from statestore.store.pg_pool import LeanPool
from statestore.store.turn_records import TurnCommit

# asyncpg prepares each statement once per connection and reuses it (its statement cache).
ACQUIRE_BY_RESPONSE = """
UPDATE threads SET lease_token = $5, lease_expires_ms = $6
WHERE id = $1 AND owner = $2 AND head_message_id = $3 AND expires_ms > $4
  AND (lease_token IS NULL OR lease_expires_ms <= $4)
RETURNING id, session_id, system, tools, system_fp, tools_fp, output_config_fp, fixed_markers, head_position,
  byte_count, ttl_seconds, base_position, base_bytes, COALESCE(octet_length(context_head), 0) AS head_bytes,
  context_tokens
"""

# The day's usage counters (the console's charts) move in the same statement as the head: counted exactly when the
# turn is stored, without a scan of history or another round trip.
COMMIT_TURN = """
WITH moved AS (
    UPDATE threads SET
        head_message_id = $3,
        head_position = head_position + cardinality($9::integer[]),
        byte_count = byte_count + $4,
        turn_count = turn_count + 1,
        usage_input_tokens = usage_input_tokens + $13,
        usage_output_tokens = usage_output_tokens + $14,
        usage_cache_creation_input_tokens = usage_cache_creation_input_tokens + $15,
        usage_cache_read_input_tokens = usage_cache_read_input_tokens + $16,
        lease_token = NULL,
        lease_expires_ms = NULL,
        ttl_seconds = $5,
        updated_ms = $6,
        expires_ms = $7,
        metadata_user_id = COALESCE(metadata_user_id, $8::varchar),
        context_tokens = $19,
        base_position = CASE WHEN $20::boolean THEN $21::integer ELSE base_position END,
        base_bytes = CASE WHEN $20::boolean THEN $22::bigint ELSE base_bytes END,
        context_head = CASE WHEN $20::boolean THEN $23::bytea ELSE context_head END,
        context_compacted = context_compacted + $24,
        context_truncated = context_truncated + $25,
        context_summarized = context_summarized + $26,
        last_model = $27::varchar,
        last_max_tokens = $28::integer
    WHERE id = $1 AND lease_token = $2
    RETURNING id
), counted AS (
    INSERT INTO daily_usage (day, shard, door, turns, bytes)
    SELECT $17, $18, 'messages', 1, $4 FROM moved
    ON CONFLICT (day, shard) DO UPDATE
    SET turns = daily_usage.turns + 1, bytes = daily_usage.bytes + EXCLUDED.bytes
)
INSERT INTO thread_messages (thread_id, position, body, response_id, backend_id)
SELECT moved.id, m.position, m.body, m.response_id, m.backend_id
FROM moved, unnest($9::integer[], $10::bytea[], $11::varchar[], $12::varchar[])
    AS m(position, body, response_id, backend_id)
"""

RENEW_LEASE = "UPDATE threads SET lease_expires_ms = $3 WHERE id = $1 AND lease_token = $2"
RELEASE = "UPDATE threads SET lease_token = NULL, lease_expires_ms = NULL WHERE id = $1 AND lease_token = $2"
# The context a rebuild sends, in one snapshot: the head (position -1) and the stored messages from the base on.
LOAD_CONTEXT = """
SELECT -1 AS position, context_head AS body FROM threads WHERE id = $1 AND context_head IS NOT NULL
UNION ALL
SELECT position, body FROM thread_messages
WHERE thread_id = $1 AND position >= (SELECT base_position FROM threads WHERE id = $1)
ORDER BY 1
"""


def context_params(commit: TurnCommit) -> tuple[Any, ...]:
    """COMMIT_TURN's parameters $19 to $26: the context after the turn and the move of its base (PROTOCOL §9)."""
    move = commit.move
    if move is None:
        return (commit.context_tokens, False, 0, 0, None, 0, 0, 0)
    return (
        commit.context_tokens,
        True,
        move.base_position,
        move.base_bytes,
        move.head,
        move.count("compacted"),
        move.count("truncated"),
        move.count("summarized"),
    )


def asyncpg_dsn(sqlalchemy_url: str) -> str:
    return make_url(sqlalchemy_url).set(drivername="postgresql").render_as_string(hide_password=False)


class PgTurnStatements:
    def __init__(self, leases: LeanPool, durable: LeanPool) -> None:
        self._leases = leases
        self._durable = durable

    @classmethod
    async def open(cls, settings: Settings) -> PgTurnStatements | None:
        """The pools, or None when the database is not PostgreSQL. Connections are made on first use."""
        if not settings.database_url.startswith("postgresql"):
            return None
        dsn = asyncpg_dsn(settings.database_url)
        # The bounds mirror the engine's: a hung database fails a turn within the timeout (503), it never holds it.
        timeout = settings.database_timeout_seconds
        # Lease statements are short and never wait for a flush: half the connections serve them.
        leases = LeanPool(
            dsn,
            max_size=max(2, settings.database_pool_size // 2),
            timeout=timeout,
            server_settings={"application_name": "statestore", "synchronous_commit": "off"},
        )
        durable = LeanPool(
            dsn,
            max_size=settings.database_pool_size,
            timeout=timeout,
            server_settings={"application_name": "statestore"},
        )
        return cls(leases, durable)

    async def aclose(self) -> None:
        await self._leases.close()
        await self._durable.close()

    def lease_connection(self) -> Any:
        """A connection of the asynchronous-commit pool (responses/pg_statements.py shares the pools)."""
        return self._leases.acquire()

    def durable_connection(self) -> Any:
        return self._durable.acquire()

    async def acquire_by_response(self, *args: Any) -> asyncpg.Record | None:
        """(thread, owner, head response id, now, token, lease until) → the leased row, or None."""
        async with self._leases.acquire() as conn:
            row: asyncpg.Record | None = await conn.fetchrow(ACQUIRE_BY_RESPONSE, *args)
        return row

    async def renew(self, thread_id: str, token: str, lease_until_ms: int) -> bool:
        async with self._leases.acquire() as conn:
            status: str = await conn.execute(RENEW_LEASE, thread_id, token, lease_until_ms)
        return status == "UPDATE 1"

    async def release(self, thread_id: str, token: str) -> None:
        async with self._leases.acquire() as conn:
            await conn.execute(RELEASE, thread_id, token)

    async def commit_turn(self, *args: Any) -> int:
        """The head move and the inserts as one statement, one round trip; returns the rows inserted (0: the lease
        was lost and nothing changed)."""
        async with self._durable.acquire() as conn:
            status: str = await conn.execute(COMMIT_TURN, *args)
        return int(status.rsplit(" ", 1)[-1])

    async def load_context(self, thread_id: str) -> list[tuple[int, bytes]]:
        async with self._durable.acquire() as conn:
            rows = await conn.fetch(LOAD_CONTEXT, thread_id)
        return [(row[0], row[1]) for row in rows]
