"""The threads' repository (the Messages door's threads and sessions): the statements only a thread has, around the
lease and commit a turn takes through the leased log (core/leased_log.py): creating one, binding its session name,
telling why a continue was refused, reading what a rebuild sends.

The authority for "who may continue" is the leased log's conditional update: the expected head, no live lease,
not expired.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from sqlalchemy import delete, exists, insert, literal_column, or_, select, union_all
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.sql.elements import ColumnElement

from statestore.content_keys import ContentKeys
from statestore.store.lease_statements import LEASED_COLUMNS, leased_thread
from statestore.store.pg_hot_path import PgHotPath
from statestore.store.schema import sessions, thread_messages, threads
from statestore.store.statement import CoreStatement, core_param
from statestore.store.thread_sealing import context_data, field_data, open_rows, opened_thread, thread_scope
from statestore.store.turn_records import ContinueRefusal, LeasedThread, NewThread


def _lease_is_free(now_ms: int) -> ColumnElement[bool]:
    return or_(threads.c.lease_token.is_(None), threads.c.lease_expires_ms <= now_ms)


@dataclass(slots=True, kw_only=True)
class LoadContext:
    thread_id: str


# The context a rebuild sends, in one snapshot: the head (position -1) and the stored messages from the base on.
# Written once: PostgreSQL runs it compiled (LOAD_CONTEXT.pg), SQLite through Core.
_base = select(threads.c.base_position).where(threads.c.id == core_param("thread_id")).scalar_subquery()
_head = select(literal_column("-1").label("position"), threads.c.context_head.label("body")).where(
    threads.c.id == core_param("thread_id"), threads.c.context_head.is_not(None)
)
_stored = select(thread_messages.c.position, thread_messages.c.body).where(
    thread_messages.c.thread_id == core_param("thread_id"), thread_messages.c.position >= _base
)
LOAD_CONTEXT: Final = CoreStatement(LoadContext, union_all(_head, _stored).order_by("position"), durable=True)
_LOAD_CONTEXT_PG: Final = LOAD_CONTEXT.on_pg()


class ThreadRepository:
    def __init__(
        self,
        engine: AsyncEngine,
        single_statements: AsyncEngine | None = None,
        *,
        pg: PgHotPath | None = None,
        content: ContentKeys | None = None,
    ) -> None:
        """`single_statements`: an engine in AUTOCOMMIT for the statements that are atomic by themselves, so they run
        without BEGIN/COMMIT round trips (its own pool: switching a pooled connection's isolation level on every
        checkout costs more than the statement). `pg`: PostgreSQL's hot statements on asyncpg. `content`: the keys a
        thread's content is sealed and opened through (store/thread_sealing.py); None, or not enabled, stores and
        reads it as it is."""
        self.engine = engine
        self._is_postgres = engine.dialect.name == "postgresql"
        self._single = single_statements or engine.execution_options(isolation_level="AUTOCOMMIT")
        self._pg = pg
        self._content = content if content is not None and content.enabled else None

    async def why_not_continuable(
        self, *, owner: str, thread_id: str, response_id: str, now_ms: int
    ) -> ContinueRefusal:
        """Why the leased log's `take_thread` found nothing: only on the error path, so it may take a second query."""
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

    async def read_by_response(
        self, *, owner: str, thread_id: str, response_id: str, now_ms: int
    ) -> LeasedThread | None:
        """The live thread whose head is `response_id`, as a continue would lease it, without the lease: a count of
        the tokens a continue would send (docs/protocol.md §11) holds nothing and waits for nothing."""
        return await self._read(
            threads.c.id == thread_id,
            threads.c.owner == owner,
            threads.c.head_message_id == response_id,
            threads.c.expires_ms > now_ms,
        )

    async def read_by_session(self, *, owner: str, session: str, now_ms: int) -> LeasedThread | None:
        """The session's live thread, as a session turn would lease it, without the lease."""
        bound = select(sessions.c.thread_id).where(sessions.c.owner == owner, sessions.c.name == session)
        return await self._read(
            threads.c.id == bound.scalar_subquery(),
            threads.c.owner == owner,
            threads.c.head_message_id.is_not(None),
            threads.c.expires_ms > now_ms,
        )

    async def _read(self, *chosen: ColumnElement[bool]) -> LeasedThread | None:
        async with self._single.connect() as conn:
            row = (await conn.execute(select(*LEASED_COLUMNS).where(*chosen))).first()
        if row is None:
            return None
        read = leased_thread(row._mapping)
        return read if self._content is None else await opened_thread(self._content, read)

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
        system, tools = thread.system, thread.tools
        if self._content is not None and (system is not None or tools is not None):
            sealer = await self._content.sealer(thread_scope(thread.owner, thread.tenant_id, thread.metadata_user_id))
            if system is not None:
                system = sealer.seal(system, field_data(thread.owner, thread.id, "system"))
            if tools is not None:
                tools = sealer.seal(tools, field_data(thread.owner, thread.id, "tools"))
        async with self.engine.begin() as conn:
            await conn.execute(
                insert(threads).values(
                    id=thread.id,
                    owner=thread.owner,
                    tenant_id=thread.tenant_id,
                    session_id=thread.session_id,
                    metadata_user_id=thread.metadata_user_id,
                    system=system,
                    tools=tools,
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

    async def load_context(self, thread_id: str, *, owner: str) -> list[tuple[int, bytes]]:
        """What a rebuild sends, in order: (-1, the head) when the thread has one, then (position, message bytes) of
        every stored message from the base on; opened, when sealed, all at once."""
        rows = await self._load_context(thread_id)
        if self._content is None or not rows:
            return rows
        opened = await open_rows(
            self._content,
            [body for _, body in rows],
            [context_data(owner, thread_id, position) for position, _ in rows],
            table="thread_messages",
            thread_id=thread_id,
        )
        return [(position, body) for (position, _), body in zip(rows, opened, strict=True)]

    async def _load_context(self, thread_id: str) -> list[tuple[int, bytes]]:
        if self._pg is not None:
            records = await self._pg.fetch(_LOAD_CONTEXT_PG, LoadContext(thread_id=thread_id))
            return [(record[0], record[1]) for record in records]
        async with self._single.connect() as conn:
            rows = await conn.execute(LOAD_CONTEXT.statement, LOAD_CONTEXT.values(LoadContext(thread_id=thread_id)))
        return [(position, bytes(body)) for position, body in rows.all()]
