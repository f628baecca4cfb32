"""A thread turn's commit: append its messages, move the head, add to the day's usage, give the lease back, all at
once and only if the turn still holds the lease (store/leased_log.py). On PostgreSQL one prepared statement, one
round trip, one durable flush; on SQLite (and for a commit that rebinds a session name) a transaction of Core
statements.

The (thread_id, position) primary key of thread_messages is the last line of defence against a double append.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import func, insert, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from statestore.content_keys import CLEAR
from statestore.store import usage_rows
from statestore.store.pg_hot_path import PgHotPath
from statestore.store.schema import sessions, thread_messages, threads
from statestore.store.statement import PgStatement
from statestore.store.thread_sealing import field_data, message_data
from statestore.store.turn_records import HeadAfter, TurnCommit


def usage_key(commit: TurnCommit) -> tuple[int, int]:
    """The daily_usage row a commit adds to: the Messages door's shard of the thread (store/usage_rows.py)."""
    return usage_rows.usage_key("messages", commit.now_ms, commit.thread_id)


@dataclass(slots=True, kw_only=True)
class CommitThreadTurn:
    """PG_COMMIT_THREAD_TURN's parameters: the messages as parallel arrays (one unnest inserts them all)."""

    thread_id: str
    # The turn's token; a claimed turn (store/thread_claims.py) also the head it was sent with, which it commits on
    # unless it took the database's lease with its token meanwhile (a long turn).
    token: str
    expected_head: str | None
    head_message_id: str
    added_bytes: int
    ttl_seconds: int
    now_ms: int
    expires_ms: int
    metadata_user_id: str | None
    positions: list[int]
    bodies: list[bytes]
    response_ids: list[str | None]
    backend_ids: list[str | None]
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    day: int
    shard: int
    # The context after the turn and the move of its base (docs/protocol.md §9); `moved` False leaves the base alone.
    context_tokens: int
    moved: bool
    base_position: int
    base_bytes: int
    context_head: bytes | None
    compacted: int
    truncated: int
    summarized: int
    model: str | None
    max_tokens: int | None

    @classmethod
    def of(cls, commit: TurnCommit) -> CommitThreadTurn:
        rows = commit.rows
        day, shard = usage_key(commit)
        move = commit.move
        usage = commit.usage
        if move is None:
            moved, base_position, base_bytes, head, compacted, truncated, summarized = False, 0, 0, None, 0, 0, 0
        else:
            moved, base_position, base_bytes, head = True, move.base_position, move.base_bytes, move.head
            compacted, truncated = move.count("compacted"), move.count("truncated")
            summarized = move.count("summarized")
        positions = [commit.start_position + offset for offset in range(len(rows))]
        bodies = [body for body, _ in rows]
        sealer = commit.sealer
        if sealer is not CLEAR:
            # Sealed here, after the sizes are counted from the plaintext (byte counts say what a rebuild sends).
            if not commit.owner:
                raise ValueError("a sealed commit names its owner")
            owner, thread_id = commit.owner, commit.thread_id
            bodies = [
                sealer.seal(body, message_data(owner, thread_id, p)) for body, p in zip(bodies, positions, strict=True)
            ]
            if head is not None:
                head = sealer.seal(head, field_data(owner, thread_id, "context_head"))
        return cls(
            thread_id=commit.thread_id,
            token=commit.lease_token,
            expected_head=commit.expected_head,
            head_message_id=commit.head_message_id,
            added_bytes=sum(len(body) for body, _ in rows),
            ttl_seconds=commit.ttl_seconds,
            now_ms=commit.now_ms,
            expires_ms=commit.expires_ms,
            metadata_user_id=commit.metadata_user_id,
            positions=positions,
            bodies=bodies,
            response_ids=[response_id for _, response_id in rows],
            backend_ids=[commit.reply_backend_id if response_id is not None else None for _, response_id in rows],
            input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens,
            cache_creation_input_tokens=usage.cache_creation_input_tokens,
            cache_read_input_tokens=usage.cache_read_input_tokens,
            day=day,
            shard=shard,
            context_tokens=commit.context_tokens,
            moved=moved,
            base_position=base_position,
            base_bytes=base_bytes,
            context_head=head,
            compacted=compacted,
            truncated=truncated,
            summarized=summarized,
            model=commit.model,
            max_tokens=commit.max_tokens,
        )


# The day's usage counters (the console's charts) move in the same statement as the head: counted exactly when the
# turn is stored, without a scan of history or another round trip.
PG_COMMIT_THREAD_TURN: Final = PgStatement(
    CommitThreadTurn,
    """
WITH moved AS (
    UPDATE threads SET
        head_message_id = :head_message_id,
        head_position = head_position + cardinality(:positions::integer[]),
        byte_count = byte_count + :added_bytes,
        turn_count = turn_count + 1,
        usage_input_tokens = usage_input_tokens + :input_tokens,
        usage_output_tokens = usage_output_tokens + :output_tokens,
        usage_cache_creation_input_tokens = usage_cache_creation_input_tokens + :cache_creation_input_tokens,
        usage_cache_read_input_tokens = usage_cache_read_input_tokens + :cache_read_input_tokens,
        lease_token = NULL,
        lease_expires_ms = NULL,
        ttl_seconds = :ttl_seconds,
        updated_ms = :now_ms,
        expires_ms = :expires_ms,
        metadata_user_id = COALESCE(metadata_user_id, :metadata_user_id::varchar),
        context_tokens = :context_tokens,
        base_position = CASE WHEN :moved::boolean THEN :base_position::integer ELSE base_position END,
        base_bytes = CASE WHEN :moved::boolean THEN :base_bytes::bigint ELSE base_bytes END,
        context_head = CASE WHEN :moved::boolean THEN :context_head::bytea ELSE context_head END,
        context_compacted = context_compacted + :compacted,
        context_truncated = context_truncated + :truncated,
        context_summarized = context_summarized + :summarized,
        last_model = :model::varchar,
        last_max_tokens = :max_tokens::integer
    WHERE id = :thread_id AND (
        lease_token = :token
        OR (head_message_id = :expected_head::varchar AND expires_ms > :now_ms
            AND (lease_token IS NULL OR lease_expires_ms <= :now_ms))
    )
    RETURNING id, head_position, byte_count, ttl_seconds, expires_ms, base_position, base_bytes,
        COALESCE(octet_length(context_head), 0) AS head_bytes, context_tokens, metadata_user_id
), counted AS (
    INSERT INTO daily_usage (day, shard, door, turns, bytes)
    SELECT :day, :shard, 'messages', 1, :added_bytes FROM moved
    ON CONFLICT (day, shard) DO UPDATE
    SET turns = daily_usage.turns + 1, bytes = daily_usage.bytes + EXCLUDED.bytes
), added AS (
    INSERT INTO thread_messages (thread_id, position, body, response_id, backend_id)
    SELECT moved.id, m.position, m.body, m.response_id, m.backend_id
    FROM moved, unnest(:positions::integer[], :bodies::bytea[], :response_ids::varchar[], :backend_ids::varchar[])
        AS m(position, body, response_id, backend_id)
    RETURNING 1
)
SELECT moved.*, (SELECT count(*) FROM added) AS added FROM moved
""",
    durable=True,
)


async def commit_thread_turn(engine: AsyncEngine, pg: PgHotPath | None, commit: TurnCommit) -> HeadAfter | bool:
    """The row as the commit left it (PostgreSQL), or True, when stored; False when the turn no longer held the lease
    or, claimed, the head moved (nothing changed). Both dialects bind from the one CommitThreadTurn."""
    params = CommitThreadTurn.of(commit)
    if pg is not None and commit.rebind_session is None:
        row = await pg.fetchrow(PG_COMMIT_THREAD_TURN, params)
        if row is None:  # the lease was lost, or the head moved: nothing changed
            return False
        if row["added"] != len(params.positions):
            raise RuntimeError("a thread commit inserted fewer messages than it moved the head by")
        return HeadAfter(
            head_position=row["head_position"],
            byte_count=row["byte_count"],
            ttl_seconds=row["ttl_seconds"],
            expires_ms=row["expires_ms"],
            base_position=row["base_position"],
            base_bytes=row["base_bytes"],
            head_bytes=row["head_bytes"],
            context_tokens=row["context_tokens"],
            metadata_user_id=row["metadata_user_id"],
        )
    if params.expected_head is not None:
        raise ValueError("a claimed turn commits on PostgreSQL's prepared statement only")
    postgres = engine.dialect.name == "postgresql"
    async with engine.begin() as conn:
        moved = await conn.execute(
            update(threads)
            .where(threads.c.id == params.thread_id, threads.c.lease_token == params.token)
            .values(
                head_message_id=params.head_message_id,
                head_position=threads.c.head_position + len(params.positions),
                byte_count=threads.c.byte_count + params.added_bytes,
                turn_count=threads.c.turn_count + 1,
                usage_input_tokens=threads.c.usage_input_tokens + params.input_tokens,
                usage_output_tokens=threads.c.usage_output_tokens + params.output_tokens,
                usage_cache_creation_input_tokens=threads.c.usage_cache_creation_input_tokens
                + params.cache_creation_input_tokens,
                usage_cache_read_input_tokens=threads.c.usage_cache_read_input_tokens + params.cache_read_input_tokens,
                lease_token=None,
                lease_expires_ms=None,
                ttl_seconds=params.ttl_seconds,
                updated_ms=params.now_ms,
                expires_ms=params.expires_ms,
                metadata_user_id=func.coalesce(threads.c.metadata_user_id, params.metadata_user_id),
                **_context_values(params),
                last_model=params.model,
                last_max_tokens=params.max_tokens,
            )
        )
        if moved.rowcount != 1:
            await conn.rollback()
            return False
        await conn.execute(
            insert(thread_messages),
            [
                {
                    "thread_id": params.thread_id,
                    "position": position,
                    "body": body,
                    "response_id": response_id,
                    "backend_id": backend_id,
                }
                for position, body, response_id, backend_id in zip(
                    params.positions, params.bodies, params.response_ids, params.backend_ids, strict=True
                )
            ],
        )
        await _count_usage(conn, params, postgres=postgres)
        if commit.rebind_session is not None:
            await _rebind_session(conn, commit.rebind_session, params.thread_id, params.now_ms, postgres=postgres)
    return True


def _context_values(params: CommitThreadTurn) -> dict[str, Any]:
    values: dict[str, Any] = {"context_tokens": params.context_tokens}
    if params.moved:
        values |= {
            "base_position": params.base_position,
            "base_bytes": params.base_bytes,
            "context_head": params.context_head,
            "context_compacted": threads.c.context_compacted + params.compacted,
            "context_truncated": threads.c.context_truncated + params.truncated,
            "context_summarized": threads.c.context_summarized + params.summarized,
        }
    return values


async def _count_usage(conn: AsyncConnection, params: CommitThreadTurn, *, postgres: bool) -> None:
    """The day's counters, in the commit's transaction (PostgreSQL's one-statement commit does this in a CTE)."""
    await conn.execute(
        usage_rows.count_usage(
            is_postgres=postgres, door="messages", day=params.day, shard=params.shard, added_bytes=params.added_bytes
        )
    )


async def _rebind_session(
    conn: AsyncConnection, session: tuple[str, str], thread_id: str, now_ms: int, *, postgres: bool
) -> None:
    """Bind the name to this thread, whatever thread holds it now: an explicit create with a session header
    (docs/protocol.md §6)."""
    owner, name = session
    dialect_insert = postgresql.insert if postgres else sqlite.insert
    stmt = dialect_insert(sessions).values(owner=owner, name=name, thread_id=thread_id, updated_ms=now_ms)
    await conn.execute(
        stmt.on_conflict_do_update(
            index_elements=[sessions.c.owner, sessions.c.name],
            set_={"thread_id": stmt.excluded.thread_id, "updated_ms": stmt.excluded.updated_ms},
        )
    )
