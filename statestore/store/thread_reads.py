"""The owner's view of its threads (docs/protocol.md §7): list, metadata, export, sessions. Cold paths, SQLAlchemy
Core."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import and_, func, or_, select
from sqlalchemy.engine import RowMapping
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.sql.elements import ColumnElement

from statestore.content_keys import ContentKeys
from statestore.store.schema import sessions, thread_messages, threads
from statestore.store.thread_sealing import field_data, message_data, open_rows
from statestore.store.turn_records import TurnUsage


@dataclass(frozen=True, slots=True)
class ContextInfo:
    """What a rebuild sends (docs/protocol.md §9): the base and the context's size, and how often it moved."""

    tokens: int
    base_position: int
    messages: int
    bytes: int
    compacted: int
    truncated: int
    summarized: int


@dataclass(frozen=True, slots=True)
class ThreadInfo:
    id: str
    session_id: str | None
    created_ms: int
    updated_ms: int
    expires_ms: int
    message_count: int
    turn_count: int
    byte_count: int
    head_message_id: str
    usage: TurnUsage
    context: ContextInfo


@dataclass(frozen=True, slots=True)
class ThreadExport:
    system: bytes | None
    tools: bytes | None
    messages: list[bytes]
    model: str | None = None
    max_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class StoredReply:
    """A reply as its thread stores it (`{"role": "assistant", "content": [...]}`, opened), with what a turn's answer
    says beside it: the thread's expiry and session, and the model its latest turn asked for."""

    body: bytes
    expires_ms: int
    session_id: str | None
    model: str | None


_INFO_COLUMNS = (
    threads.c.id,
    threads.c.session_id,
    threads.c.created_ms,
    threads.c.updated_ms,
    threads.c.expires_ms,
    threads.c.head_position,
    threads.c.turn_count,
    threads.c.byte_count,
    threads.c.head_message_id,
    threads.c.usage_input_tokens,
    threads.c.usage_output_tokens,
    threads.c.usage_cache_creation_input_tokens,
    threads.c.usage_cache_read_input_tokens,
    threads.c.context_tokens,
    threads.c.base_position,
    threads.c.base_bytes,
    func.coalesce(func.length(threads.c.context_head), 0).label("head_bytes"),
    threads.c.context_compacted,
    threads.c.context_truncated,
    threads.c.context_summarized,
)


def _info(m: RowMapping) -> ThreadInfo:
    return ThreadInfo(
        id=m["id"],
        session_id=m["session_id"],
        created_ms=m["created_ms"],
        updated_ms=m["updated_ms"],
        expires_ms=m["expires_ms"],
        message_count=m["head_position"],
        turn_count=m["turn_count"],
        byte_count=m["byte_count"],
        head_message_id=m["head_message_id"],
        usage=TurnUsage(
            input_tokens=m["usage_input_tokens"],
            output_tokens=m["usage_output_tokens"],
            cache_creation_input_tokens=m["usage_cache_creation_input_tokens"],
            cache_read_input_tokens=m["usage_cache_read_input_tokens"],
        ),
        context=ContextInfo(
            tokens=m["context_tokens"],
            base_position=m["base_position"],
            messages=m["head_position"] - m["base_position"] + (1 if m["head_bytes"] else 0),
            bytes=m["byte_count"] - m["base_bytes"] + m["head_bytes"],
            compacted=m["context_compacted"],
            truncated=m["context_truncated"],
            summarized=m["context_summarized"],
        ),
    )


def live(owner: str, now_ms: int) -> ColumnElement[bool]:
    return and_(threads.c.owner == owner, threads.c.expires_ms > now_ms, threads.c.head_message_id.is_not(None))


class ThreadQueries:
    """The owner's view of its threads (docs/protocol.md §7)."""

    def __init__(self, engine: AsyncEngine, content: ContentKeys | None = None) -> None:
        """`content`: what a sealed thread's content opens through (export stays in clear for its owner)."""
        self.engine = engine
        self._content = content if content is not None and content.enabled else None

    async def list_threads(
        self, owner: str, *, now_ms: int, limit: int, after: str | None, session_id: str | None
    ) -> tuple[list[ThreadInfo], bool] | None:
        """A page of live threads, newest first, and whether more follow. None when `after` names no live thread."""
        stmt = select(*_INFO_COLUMNS).where(live(owner, now_ms))
        if session_id is not None:
            stmt = stmt.where(threads.c.session_id == session_id)
        async with self.engine.connect() as conn:
            if after is not None:
                cursor = (
                    await conn.execute(select(threads.c.updated_ms).where(threads.c.id == after, live(owner, now_ms)))
                ).first()
                if cursor is None:
                    return None
                stmt = stmt.where(
                    or_(
                        threads.c.updated_ms < cursor.updated_ms,
                        and_(threads.c.updated_ms == cursor.updated_ms, threads.c.id < after),
                    )
                )
            stmt = stmt.order_by(threads.c.updated_ms.desc(), threads.c.id.desc()).limit(limit + 1)
            rows = (await conn.execute(stmt)).all()
        return [_info(row._mapping) for row in rows[:limit]], len(rows) > limit

    async def thread_info(self, owner: str, thread_id: str, *, now_ms: int) -> ThreadInfo | None:
        async with self.engine.connect() as conn:
            row = (
                await conn.execute(select(*_INFO_COLUMNS).where(threads.c.id == thread_id, live(owner, now_ms)))
            ).first()
        return _info(row._mapping) if row is not None else None

    async def export(
        self, owner: str, thread_id: str, *, now_ms: int, context_only: bool = False
    ) -> ThreadExport | None:
        """Every stored message (the archive), or with `context_only` what the next turn sends before its own new
        messages: the context head, then the stored messages from the base on (docs/protocol.md §9)."""
        async with self.engine.connect() as conn:
            row = (
                await conn.execute(
                    select(
                        threads.c.system,
                        threads.c.tools,
                        threads.c.head_position,
                        threads.c.base_position,
                        threads.c.context_head,
                        threads.c.last_model,
                        threads.c.last_max_tokens,
                    ).where(threads.c.id == thread_id, live(owner, now_ms))
                )
            ).first()
            if row is None:
                return None
            first = row.base_position if context_only else 0
            bodies = (
                await conn.execute(
                    select(thread_messages.c.position, thread_messages.c.body)
                    .where(
                        thread_messages.c.thread_id == thread_id,
                        thread_messages.c.position >= first,
                        thread_messages.c.position < row.head_position,
                    )
                    .order_by(thread_messages.c.position)
                )
            ).all()
        positions = [position for position, _ in bodies]
        messages = [bytes(body) for _, body in bodies]
        head = bytes(row.context_head) if context_only and row.context_head is not None else None
        system, tools = row.system, row.tools
        if self._content is not None:
            system, tools, head, messages = await self._open_export(
                owner, thread_id, system=system, tools=tools, head=head, positions=positions, messages=messages
            )
        if head is not None:
            messages.insert(0, head)
        return ThreadExport(
            system=system,
            tools=tools,
            messages=messages,
            model=row.last_model,
            max_tokens=row.last_max_tokens,
        )

    async def stored_reply(self, owner: str, thread_id: str, response_id: str, *, now_ms: int) -> StoredReply | None:
        """The reply `response_id` of the owner's live thread, or None: how a retry under an Idempotency-Key finds a
        turn that was stored though its outcome was never kept (api/threaded_keyed.py)."""
        stmt = (
            select(
                thread_messages.c.position,
                thread_messages.c.body,
                threads.c.expires_ms,
                threads.c.session_id,
                threads.c.last_model,
            )
            .join(threads, threads.c.id == thread_messages.c.thread_id)
            .where(
                thread_messages.c.thread_id == thread_id,
                thread_messages.c.response_id == response_id,
                threads.c.id == thread_id,
                live(owner, now_ms),
            )
        )
        async with self.engine.connect() as conn:
            row = (await conn.execute(stmt)).first()
        if row is None:
            return None
        body = bytes(row.body)
        if self._content is not None:
            (body,) = await open_rows(
                self._content,
                [body],
                [message_data(owner, thread_id, row.position)],
                table="thread_messages",
                thread_id=thread_id,
            )
        return StoredReply(body=body, expires_ms=row.expires_ms, session_id=row.session_id, model=row.last_model)

    async def _open_export(
        self,
        owner: str,
        thread_id: str,
        *,
        system: bytes | None,
        tools: bytes | None,
        head: bytes | None,
        positions: list[int],
        messages: list[bytes],
    ) -> tuple[bytes | None, bytes | None, bytes | None, list[bytes]]:
        """An export's values opened at once (one key lookup); what was None stays None."""
        assert self._content is not None
        fields = [
            (system, field_data(owner, thread_id, "system")),
            (tools, field_data(owner, thread_id, "tools")),
            (head, field_data(owner, thread_id, "context_head")),
        ]
        present = [(bytes(value), data) for value, data in fields if value is not None]
        values = [value for value, _ in present] + messages
        data = [d for _, d in present] + [message_data(owner, thread_id, p) for p in positions]
        opened = await open_rows(self._content, values, data, table="threads", thread_id=thread_id)
        it = iter(opened)
        system, tools, head = (next(it) if value is not None else None for value, _ in fields)
        return system, tools, head, list(it)

    async def session_thread(self, owner: str, session: str, *, now_ms: int) -> ThreadInfo | None:
        bound = select(sessions.c.thread_id).where(sessions.c.owner == owner, sessions.c.name == session)
        async with self.engine.connect() as conn:
            row = (
                await conn.execute(
                    select(*_INFO_COLUMNS).where(threads.c.id == bound.scalar_subquery(), live(owner, now_ms))
                )
            ).first()
        return _info(row._mapping) if row is not None else None
