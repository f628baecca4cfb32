"""The SQL of a threaded turn: take the head (the lease), append the turn, give the head back (SQLAlchemy Core; on
PostgreSQL the hot statements go through `pg_turns`, prepared statements on asyncpg).

The authority for "who may continue" is the conditional update in `acquire_*`: the expected head, no live lease,
not expired. The (thread_id, position) primary key of thread_messages is the last line of defence against a
double append.
"""

from __future__ import annotations

from sqlalchemy import bindparam, delete, exists, func, insert, literal, or_, select, union_all, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.sql.elements import ColumnElement

from statestore.store.pg_turns import PgTurnStatements, context_params
from statestore.store.schema import sessions, thread_messages, threads
from statestore.store.turn_records import (
    ContextMove,
    ContinueRefusal,
    LeasedThread,
    NewThread,
    TurnCommit,
    TurnUsage,
)
from statestore.store.turn_rows import LEASED_COLUMNS, context_values, leased_thread
from statestore.store.usage_rows import count_usage, usage_key

__all__ = ["ContextMove", "ContinueRefusal", "LeasedThread", "NewThread", "ThreadRepository", "TurnCommit", "TurnUsage"]


def _lease_is_free(now_ms: int) -> ColumnElement[bool]:
    return or_(threads.c.lease_token.is_(None), threads.c.lease_expires_ms <= now_ms)


# The hot path's lease statement, built once: SQLAlchemy would otherwise rebuild and re-hash the expression on every
# call before finding its compiled form. Parameter names avoid column names, which an UPDATE would take as SET values.
_ACQUIRE_BY_RESPONSE = (
    update(threads)
    .where(
        threads.c.id == bindparam("p_thread"),
        threads.c.owner == bindparam("p_owner"),
        threads.c.head_message_id == bindparam("p_head"),
        threads.c.expires_ms > bindparam("p_now"),
        or_(threads.c.lease_token.is_(None), threads.c.lease_expires_ms <= bindparam("p_now")),
    )
    .values(lease_token=bindparam("p_token"), lease_expires_ms=bindparam("p_until"))
    .returning(*LEASED_COLUMNS)
)


class ThreadRepository:
    def __init__(
        self, engine: AsyncEngine, single_statements: AsyncEngine | None = None, *, pg: PgTurnStatements | None = None
    ) -> None:
        """`single_statements`: an engine in AUTOCOMMIT for the statements that are atomic by themselves, so they run
        without BEGIN/COMMIT round trips (its own pool: switching a pooled connection's isolation level on every
        checkout costs more than the statement). `pg`: PostgreSQL's hot statements on asyncpg (store/pg_turns.py)."""
        self.engine = engine
        self._is_postgres = engine.dialect.name == "postgresql"
        self._single = single_statements or engine.execution_options(isolation_level="AUTOCOMMIT")
        self._pg = pg

    async def acquire_by_response(
        self, *, owner: str, thread_id: str, response_id: str, token: str, now_ms: int, lease_until_ms: int
    ) -> LeasedThread | None:
        if self._pg is not None:
            record = await self._pg.acquire_by_response(thread_id, owner, response_id, now_ms, token, lease_until_ms)
            return leased_thread(record) if record is not None else None
        params = {
            "p_thread": thread_id,
            "p_owner": owner,
            "p_head": response_id,
            "p_now": now_ms,
            "p_token": token,
            "p_until": lease_until_ms,
        }
        async with self._single.connect() as conn:
            row = (await conn.execute(_ACQUIRE_BY_RESPONSE, params)).first()
        return leased_thread(row._mapping) if row is not None else None

    async def why_not_continuable(
        self, *, owner: str, thread_id: str, response_id: str, now_ms: int
    ) -> ContinueRefusal:
        """Why `acquire_by_response` found nothing: only on the error path, so it may take a second query."""
        async with self._single.connect() as conn:
            row = (
                await conn.execute(
                    select(threads.c.head_message_id, threads.c.lease_token, threads.c.lease_expires_ms).where(
                        threads.c.id == thread_id, threads.c.owner == owner, threads.c.expires_ms > now_ms
                    )
                )
            ).first()
            if row is None or row.head_message_id is None:
                return "not_found"
            if row.head_message_id == response_id:
                return "in_flight"
            earlier = (
                await conn.execute(
                    select(thread_messages.c.position).where(
                        thread_messages.c.thread_id == thread_id, thread_messages.c.response_id == response_id
                    )
                )
            ).first()
        return "already_continued" if earlier is not None else "not_found"

    async def backend_id_of(self, *, owner: str, thread_id: str, response_id: str, now_ms: int) -> str | None:
        """The backend's own id of a stored reply of the owner's live thread, or None."""
        stmt = select(thread_messages.c.backend_id).where(
            thread_messages.c.thread_id == thread_id,
            thread_messages.c.response_id == response_id,
            exists().where(
                threads.c.id == thread_id,
                threads.c.owner == owner,
                threads.c.expires_ms > now_ms,
                threads.c.head_message_id.is_not(None),
            ),
        )
        async with self._single.connect() as conn:
            backend_id = (await conn.execute(stmt)).scalar()
        return backend_id if isinstance(backend_id, str) else None

    async def acquire_by_session(
        self, *, owner: str, session: str, token: str, now_ms: int, lease_until_ms: int
    ) -> LeasedThread | None:
        bound = select(sessions.c.thread_id).where(sessions.c.owner == owner, sessions.c.name == session)
        stmt = (
            update(threads)
            .where(
                threads.c.id == bound.scalar_subquery(),
                threads.c.owner == owner,
                threads.c.head_message_id.is_not(None),
                threads.c.expires_ms > now_ms,
                _lease_is_free(now_ms),
            )
            .values(lease_token=token, lease_expires_ms=lease_until_ms)
            .returning(*LEASED_COLUMNS)
        )
        async with self._single.connect() as conn:
            row = (await conn.execute(stmt)).first()
        return leased_thread(row._mapping) if row is not None else None

    async def session_is_busy(self, *, owner: str, session: str, now_ms: int) -> bool:
        """Whether the session's thread is live but leased (or still being created) by another request."""
        stmt = select(threads.c.id).where(
            threads.c.id
            == select(sessions.c.thread_id)
            .where(sessions.c.owner == owner, sessions.c.name == session)
            .scalar_subquery(),
            threads.c.expires_ms > now_ms,
            ~_lease_is_free(now_ms),
        )
        async with self._single.connect() as conn:
            return (await conn.execute(stmt)).first() is not None

    async def begin_create(
        self, thread: NewThread, *, token: str, now_ms: int, lease_until_ms: int, bind_session: bool = True
    ) -> bool:
        """Insert the thread row, leased and without a head until its first reply commits, and (with `bind_session`)
        bind the session name to it when the name's current thread is gone. False when a live thread holds the name."""
        async with self.engine.begin() as conn:
            await conn.execute(
                insert(threads).values(
                    id=thread.id,
                    owner=thread.owner,
                    tenant_id=thread.tenant_id,
                    session_id=thread.session_id,
                    metadata_user_id=thread.metadata_user_id,
                    system=thread.system,
                    tools=thread.tools,
                    system_fp=thread.system_fp,
                    tools_fp=thread.tools_fp,
                    output_config_fp=thread.output_config_fp,
                    fixed_markers=thread.fixed_markers,
                    head_message_id=None,
                    head_position=0,
                    byte_count=0,
                    turn_count=0,
                    lease_token=token,
                    lease_expires_ms=lease_until_ms,
                    ttl_seconds=thread.ttl_seconds,
                    created_ms=now_ms,
                    updated_ms=now_ms,
                    # A create that never answers is purged like an expired thread once its lease runs out.
                    expires_ms=lease_until_ms,
                )
            )
            if bind_session and thread.session_id is not None and not await self._bind_session(conn, thread, now_ms):
                await conn.rollback()
                return False
        return True

    async def _bind_session(self, conn: AsyncConnection, thread: NewThread, now_ms: int) -> bool:
        current_is_live = exists().where(threads.c.id == sessions.c.thread_id, threads.c.expires_ms > now_ms)
        values = {"owner": thread.owner, "name": thread.session_id, "thread_id": thread.id, "updated_ms": now_ms}
        dialect_insert = postgresql.insert if self._is_postgres else sqlite.insert
        stmt = dialect_insert(sessions).values(**values)
        stmt = stmt.on_conflict_do_update(
            index_elements=[sessions.c.owner, sessions.c.name],
            set_={"thread_id": stmt.excluded.thread_id, "updated_ms": stmt.excluded.updated_ms},
            where=~current_is_live,
        )
        result = await conn.execute(stmt)
        return result.rowcount == 1

    async def commit_turn(self, commit: TurnCommit) -> bool:
        """Append the turn's messages and move the head, atomically, if this request still holds the lease."""
        added_bytes = sum(len(body) for body, _ in commit.rows)
        if self._pg is not None and commit.rebind_session is None:
            return await self._commit_in_one_statement(self._pg, commit, added_bytes)
        async with self.engine.begin() as conn:
            moved = await conn.execute(
                update(threads)
                .where(threads.c.id == commit.thread_id, threads.c.lease_token == commit.lease_token)
                .values(
                    head_message_id=commit.head_message_id,
                    head_position=threads.c.head_position + len(commit.rows),
                    byte_count=threads.c.byte_count + added_bytes,
                    turn_count=threads.c.turn_count + 1,
                    usage_input_tokens=threads.c.usage_input_tokens + commit.usage.input_tokens,
                    usage_output_tokens=threads.c.usage_output_tokens + commit.usage.output_tokens,
                    usage_cache_creation_input_tokens=threads.c.usage_cache_creation_input_tokens
                    + commit.usage.cache_creation_input_tokens,
                    usage_cache_read_input_tokens=threads.c.usage_cache_read_input_tokens
                    + commit.usage.cache_read_input_tokens,
                    lease_token=None,
                    lease_expires_ms=None,
                    ttl_seconds=commit.ttl_seconds,
                    updated_ms=commit.now_ms,
                    expires_ms=commit.expires_ms,
                    metadata_user_id=func.coalesce(threads.c.metadata_user_id, commit.metadata_user_id),
                    **context_values(commit),
                    last_model=commit.model,
                    last_max_tokens=commit.max_tokens,
                )
            )
            if moved.rowcount != 1:
                await conn.rollback()
                return False
            await conn.execute(
                insert(thread_messages),
                [
                    {
                        "thread_id": commit.thread_id,
                        "position": commit.start_position + offset,
                        "body": body,
                        "response_id": response_id,
                        "backend_id": commit.reply_backend_id if response_id is not None else None,
                    }
                    for offset, (body, response_id) in enumerate(commit.rows)
                ],
            )
            await self._count_usage(conn, commit, added_bytes)
            if commit.rebind_session is not None:
                await self._rebind_session(conn, commit.rebind_session, commit.thread_id, commit.now_ms)
        return True

    async def _count_usage(self, conn: AsyncConnection, commit: TurnCommit, added_bytes: int) -> None:
        """The day's counters, in the commit's transaction (PostgreSQL's one-statement commit does this in a CTE)."""
        await conn.execute(
            count_usage(
                is_postgres=self._is_postgres,
                door="messages",
                now_ms=commit.now_ms,
                spread_by=commit.thread_id,
                added_bytes=added_bytes,
            )
        )

    @staticmethod
    async def _commit_in_one_statement(pg: PgTurnStatements, commit: TurnCommit, added_bytes: int) -> bool:
        """PostgreSQL: the head move and the inserts as one statement, one round trip; no row inserted means the
        lease was lost and nothing changed."""
        inserted = await pg.commit_turn(
            commit.thread_id,
            commit.lease_token,
            commit.head_message_id,
            added_bytes,
            commit.ttl_seconds,
            commit.now_ms,
            commit.expires_ms,
            commit.metadata_user_id,
            [commit.start_position + offset for offset in range(len(commit.rows))],
            [body for body, _ in commit.rows],
            [response_id for _, response_id in commit.rows],
            [commit.reply_backend_id if response_id is not None else None for _, response_id in commit.rows],
            commit.usage.input_tokens,
            commit.usage.output_tokens,
            commit.usage.cache_creation_input_tokens,
            commit.usage.cache_read_input_tokens,
            *usage_key("messages", commit.now_ms, commit.thread_id),
            *context_params(commit),
            commit.model,
            commit.max_tokens,
        )
        return inserted == len(commit.rows)

    async def _rebind_session(
        self, conn: AsyncConnection, session: tuple[str, str], thread_id: str, now_ms: int
    ) -> None:
        owner, name = session
        dialect_insert = postgresql.insert if self._is_postgres else sqlite.insert
        stmt = dialect_insert(sessions).values(owner=owner, name=name, thread_id=thread_id, updated_ms=now_ms)
        await conn.execute(
            stmt.on_conflict_do_update(
                index_elements=[sessions.c.owner, sessions.c.name],
                set_={"thread_id": stmt.excluded.thread_id, "updated_ms": stmt.excluded.updated_ms},
            )
        )

    async def renew_lease(self, *, thread_id: str, token: str, lease_until_ms: int) -> bool:
        """Extend a lease this request still holds (a long stream); False when it was lost."""
        if self._pg is not None:
            return await self._pg.renew(thread_id, token, lease_until_ms)
        async with self._single.connect() as conn:
            renewed = await conn.execute(
                update(threads)
                .where(threads.c.id == thread_id, threads.c.lease_token == token)
                .values(lease_expires_ms=lease_until_ms)
            )
        return renewed.rowcount == 1

    async def release(self, *, thread_id: str, token: str) -> None:
        """Give the head back after a continue that stored nothing, so the same id can be continued again."""
        if self._pg is not None:
            await self._pg.release(thread_id, token)
            return
        async with self._single.connect() as conn:
            await conn.execute(
                update(threads)
                .where(threads.c.id == thread_id, threads.c.lease_token == token)
                .values(lease_token=None, lease_expires_ms=None)
            )

    async def abandon_create(self, *, thread_id: str, token: str) -> None:
        """Drop a thread whose create stored nothing (its session binding goes with it)."""
        async with self._single.connect() as conn:
            await conn.execute(
                delete(threads).where(
                    threads.c.id == thread_id, threads.c.lease_token == token, threads.c.head_message_id.is_(None)
                )
            )

    async def is_stored(self, *, thread_id: str, response_id: str) -> bool:
        """Whether the reply `response_id` is among the thread's stored messages (after a commit whose outcome was
        lost with its connection)."""
        stmt = select(thread_messages.c.position).where(
            thread_messages.c.thread_id == thread_id, thread_messages.c.response_id == response_id
        )
        async with self._single.connect() as conn:
            return (await conn.execute(stmt)).first() is not None

    async def load_context(self, thread_id: str) -> list[tuple[int, bytes]]:
        """What a rebuild sends, in order: (-1, the head) when the thread has one, then (position, message bytes) of
        every stored message from the base on."""
        if self._pg is not None:
            return await self._pg.load_context(thread_id)
        base = select(threads.c.base_position).where(threads.c.id == thread_id).scalar_subquery()
        head = select(literal(-1).label("position"), threads.c.context_head.label("body")).where(
            threads.c.id == thread_id, threads.c.context_head.is_not(None)
        )
        rows = select(thread_messages.c.position, thread_messages.c.body).where(
            thread_messages.c.thread_id == thread_id, thread_messages.c.position >= base
        )
        stmt = union_all(head, rows).order_by("position")
        async with self._single.connect() as conn:
            return [(position, bytes(body)) for position, body in (await conn.execute(stmt)).all()]
