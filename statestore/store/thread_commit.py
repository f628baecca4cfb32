"""A thread turn's commit: append its messages, move the head, add to the day's usage, give the lease back, all at
once and only if the turn still holds the lease (core/leased_log.py). On PostgreSQL one prepared statement, one
round trip, one durable flush; on SQLite (and for a commit that rebinds a session name) a transaction of the same
Core statements.

The (thread_id, position) primary key of thread_messages is the last line of defence against a double append.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Boolean,
    Integer,
    LargeBinary,
    Select,
    String,
    and_,
    case,
    func,
    insert,
    literal_column,
    null,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.sql.dml import Insert
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.selectable import FromClause

from statestore.content_keys import CLEAR
from statestore.store import usage_rows
from statestore.store.pg_hot_path import PgHotPath
from statestore.store.schema import sessions, thread_messages, threads
from statestore.store.statement import CoreStatement, core_param, core_values
from statestore.store.thread_sealing import field_data, message_data
from statestore.store.turn_records import HeadAfter, TurnCommit


def usage_key(commit: TurnCommit) -> tuple[int, int]:
    """The daily_usage row a commit adds to: the Messages door's shard of the thread (store/usage_rows.py)."""
    return usage_rows.usage_key("messages", commit.now_ms, commit.thread_id)


@dataclass(slots=True, kw_only=True)
class CommitThreadTurn:
    """COMMIT_THREAD_TURN's parameters: the messages as parallel arrays (PostgreSQL's one unnest inserts them all)."""

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
    count: int  # messages
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
            count=len(positions),
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


# -- the commit, written once -------------------------------------------------------------------------------------
# Its steps are Core, for both databases: the head moved (only while the turn holds the lease: a claimed turn, also
# while the head is still the one it was sent with and no lease is live), the messages appended, the day's usage
# counted (the console's charts: counted exactly when the turn is stored, without a scan of history). PostgreSQL runs
# them as one statement, compiled once for asyncpg (one round trip, one durable flush); SQLite as a transaction.
_p = core_param
_moved_flag = _p("moved", Boolean)


def _when_moved(value: ColumnElement[Any], column: ColumnElement[Any]) -> ColumnElement[Any]:
    """`value` when the turn moved its context's base (docs/protocol.md §9), else the column as it was."""
    return case((_moved_flag, value), else_=column)


_HELD = and_(
    threads.c.id == _p("thread_id"),
    or_(
        threads.c.lease_token == _p("token"),
        and_(
            threads.c.head_message_id == _p("expected_head", String),
            threads.c.expires_ms > _p("now_ms"),
            or_(threads.c.lease_token.is_(None), threads.c.lease_expires_ms <= _p("now_ms")),
        ),
    ),
)
MOVE_HEAD: Final = (
    update(threads)
    .where(_HELD)
    .values(
        head_message_id=_p("head_message_id"),
        head_position=threads.c.head_position + _p("count", Integer),
        byte_count=threads.c.byte_count + _p("added_bytes", BigInteger),
        turn_count=threads.c.turn_count + literal_column("1"),
        usage_input_tokens=threads.c.usage_input_tokens + _p("input_tokens", BigInteger),
        usage_output_tokens=threads.c.usage_output_tokens + _p("output_tokens", BigInteger),
        usage_cache_creation_input_tokens=threads.c.usage_cache_creation_input_tokens
        + _p("cache_creation_input_tokens", BigInteger),
        usage_cache_read_input_tokens=threads.c.usage_cache_read_input_tokens
        + _p("cache_read_input_tokens", BigInteger),
        lease_token=null(),
        lease_expires_ms=null(),
        ttl_seconds=_p("ttl_seconds"),
        updated_ms=_p("now_ms"),
        expires_ms=_p("expires_ms"),
        metadata_user_id=func.coalesce(threads.c.metadata_user_id, _p("metadata_user_id", String)),
        context_tokens=_p("context_tokens"),
        base_position=_when_moved(_p("base_position", Integer), threads.c.base_position),
        base_bytes=_when_moved(_p("base_bytes", BigInteger), threads.c.base_bytes),
        context_head=_when_moved(_p("context_head", LargeBinary), threads.c.context_head),
        context_compacted=threads.c.context_compacted + _p("compacted", Integer),
        context_truncated=threads.c.context_truncated + _p("truncated", Integer),
        context_summarized=threads.c.context_summarized + _p("summarized", Integer),
        last_model=_p("model", String),
        last_max_tokens=_p("max_tokens", Integer),
    )
    .returning(
        threads.c.id,
        threads.c.head_position,
        threads.c.byte_count,
        threads.c.ttl_seconds,
        threads.c.expires_ms,
        threads.c.base_position,
        threads.c.base_bytes,
        func.coalesce(func.length(threads.c.context_head), literal_column("0")).label("head_bytes"),
        threads.c.context_tokens,
        threads.c.metadata_user_id,
    )
)


def _usage(postgres: bool, after: FromClause | None = None) -> Insert:
    return usage_rows.count_usage(
        postgres=postgres,
        door="messages",
        day=_p("day", Integer),
        shard=_p("shard", Integer),
        added_bytes=_p("added_bytes", BigInteger),
        after=after,
    )


def _one_statement() -> Select[Any]:
    """The steps as one PostgreSQL statement: the messages come as parallel arrays, one unnest inserts them all."""
    moved = MOVE_HEAD.cte("moved")
    messages = (
        func.unnest(
            _p("positions", ARRAY(Integer)),
            _p("bodies", ARRAY(LargeBinary)),
            _p("response_ids", ARRAY(String)),
            _p("backend_ids", ARRAY(String)),
        )
        .table_valued("position", "body", "response_id", "backend_id")
        .render_derived(name="m")
    )
    added = (
        insert(thread_messages)
        .from_select(
            ["thread_id", "position", "body", "response_id", "backend_id"],
            select(moved.c.id, messages.c.position, messages.c.body, messages.c.response_id, messages.c.backend_id)
            .select_from(moved)
            .join(messages, true()),
        )
        .returning(literal_column("1"))
        .cte("added")
    )
    return select(moved, select(func.count()).select_from(added).scalar_subquery().label("added")).add_cte(
        _usage(True, after=moved).cte("counted")
    )


COMMIT_THREAD_TURN: Final = CoreStatement(CommitThreadTurn, _one_statement(), durable=True)
_COMMIT_THREAD_TURN_PG: Final = COMMIT_THREAD_TURN.on_pg()
_USAGE: Final = {True: _usage(True), False: _usage(False)}


async def commit_thread_turn(engine: AsyncEngine, pg: PgHotPath | None, commit: TurnCommit) -> HeadAfter | bool:
    """The row as the commit left it (PostgreSQL), or True, when stored; False when the turn no longer held the lease
    or, claimed, the head moved (nothing changed). Both databases bind from the one CommitThreadTurn."""
    params = CommitThreadTurn.of(commit)
    if pg is not None and commit.rebind_session is None:
        row = await pg.fetchrow(_COMMIT_THREAD_TURN_PG, params)
        if row is None:  # the lease was lost, or the head moved: nothing changed
            return False
        if row["added"] != params.count:
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
    postgres = engine.dialect.name == "postgresql"
    values = core_values(params)
    async with engine.begin() as conn:
        if (await conn.execute(MOVE_HEAD, values)).first() is None:
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
        await conn.execute(_USAGE[postgres], values)
        if commit.rebind_session is not None:
            await _rebind_session(conn, commit.rebind_session, params.thread_id, params.now_ms, postgres=postgres)
    return True


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
