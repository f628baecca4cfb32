"""The leased log's statements and their execution: take, renew and release a conversation's lease, and commit its
turn or an append of items (store/thread_commit.py, store/response_commit.py), each step one statement (a commit, one
transaction) that answers what it changed. What a lease is, and what a turn may rely on from each answer, is the log's
(core/leased_log.py).

Each statement written once, as SQLAlchemy Core: run through Core on SQLite, and on PostgreSQL compiled once for
asyncpg and run as a prepared statement (store/pg_hot_path.py), each bound from the same typed parameter object
(store/statement.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import Table, func, literal_column, null, or_, select, update
from sqlalchemy.engine import RowMapping
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.sql.dml import Update
from sqlalchemy.sql.elements import ColumnElement

from statestore.content_keys import ContentKeys
from statestore.store.pg_hot_path import PgHotPath
from statestore.store.response_commit import AppendItems, commit_append, commit_response
from statestore.store.response_records import NewResponse, ResponseRow, StoredItem, stored_row
from statestore.store.response_sealing import active, scope_of, seal_response
from statestore.store.schema import conversations, sessions, threads
from statestore.store.statement import CoreStatement, P, PgStatement, core_param
from statestore.store.thread_commit import commit_thread_turn
from statestore.store.thread_sealing import opened_thread
from statestore.store.turn_records import HeadAfter, LeasedThread, TurnCommit

# -- the parameters of each lease statement ------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class TakeThreadByResponse:
    thread_id: str
    owner: str
    head_message_id: str
    now_ms: int
    token: str
    until_ms: int


@dataclass(slots=True, kw_only=True)
class TakeThreadBySession:
    owner: str
    session: str
    now_ms: int
    token: str
    until_ms: int


@dataclass(slots=True, kw_only=True)
class TakeConversation:
    conversation_id: str
    owner: str
    now_ms: int
    token: str
    until_ms: int


@dataclass(slots=True, kw_only=True)
class Renew:
    log_id: str
    token: str
    until_ms: int


@dataclass(slots=True, kw_only=True)
class Release:
    log_id: str
    token: str


# -- the statements ------------------------------------------------------------------------------------------------

LEASED_COLUMNS = (
    threads.c.id,
    threads.c.owner,
    threads.c.tenant_id,
    threads.c.metadata_user_id,
    threads.c.session_id,
    threads.c.system,
    threads.c.tools,
    threads.c.system_fp,
    threads.c.tools_fp,
    threads.c.output_config_fp,
    threads.c.fixed_markers,
    threads.c.head_position,
    threads.c.byte_count,
    threads.c.ttl_seconds,
    threads.c.base_position,
    threads.c.base_bytes,
    func.coalesce(func.length(threads.c.context_head), literal_column("0")).label("head_bytes"),
    threads.c.context_tokens,
)


def _take(table: Table, *chosen: ColumnElement[bool]) -> Update:
    """The lease taken on the row `chosen` picks, if it is live and free (no lease, or one that ran out)."""
    free = or_(table.c.lease_token.is_(None), table.c.lease_expires_ms <= core_param("now_ms"))
    return (
        update(table)
        .where(*chosen, table.c.expires_ms > core_param("now_ms"), free)
        .values(lease_token=core_param("token"), lease_expires_ms=core_param("until_ms"))
    )


# Written once, built once: PostgreSQL runs each compiled for asyncpg (its `.pg`, taken once here), SQLite through
# Core, which would otherwise rebuild and re-hash each expression on every call before finding its compiled form.
# Taking a lease commits asynchronously on PostgreSQL (store/pg_hot_path.py says why that is safe).
TAKE_THREAD_BY_RESPONSE: Final = CoreStatement(
    TakeThreadByResponse,
    _take(
        threads,
        threads.c.id == core_param("thread_id"),
        threads.c.owner == core_param("owner"),
        threads.c.head_message_id == core_param("head_message_id"),
    ).returning(*LEASED_COLUMNS),
    durable=False,
)
TAKE_THREAD_BY_SESSION: Final = CoreStatement(
    TakeThreadBySession,
    _take(
        threads,
        threads.c.id
        == select(sessions.c.thread_id)
        .where(sessions.c.owner == core_param("owner"), sessions.c.name == core_param("session"))
        .scalar_subquery(),
        threads.c.owner == core_param("owner"),
        threads.c.head_message_id.is_not(None),
    ).returning(*LEASED_COLUMNS),
)
TAKE_CONVERSATION: Final = CoreStatement(
    TakeConversation,
    _take(
        conversations,
        conversations.c.id == core_param("conversation_id"),
        conversations.c.owner == core_param("owner"),
    ).returning(
        conversations.c.next_position,
        func.coalesce(conversations.c.context_tokens, literal_column("0")).label("context_tokens"),
        func.coalesce(conversations.c.context_bytes, literal_column("0")).label("context_bytes"),
    ),
    durable=False,
)
_TAKE_THREAD_BY_RESPONSE_PG: Final = TAKE_THREAD_BY_RESPONSE.on_pg()
_TAKE_CONVERSATION_PG: Final = TAKE_CONVERSATION.on_pg()


@dataclass(frozen=True, slots=True)
class LogTable:
    """A table of leased logs (each row one log, with `id`, `lease_token` and `lease_expires_ms`) and the statements
    that renew and release a lease on one of its rows, written once (as the takes are) and compiled for asyncpg."""

    name: str
    renew: CoreStatement[Renew]
    release: CoreStatement[Release]
    renew_pg: PgStatement[Renew]
    release_pg: PgStatement[Release]

    @classmethod
    def of(cls, table: Table) -> LogTable:
        held = (table.c.id == core_param("log_id"), table.c.lease_token == core_param("token"))
        renew = CoreStatement(
            Renew, update(table).where(*held).values(lease_expires_ms=core_param("until_ms")), durable=False
        )
        release = CoreStatement(
            Release, update(table).where(*held).values(lease_token=null(), lease_expires_ms=null()), durable=False
        )
        return cls(table.name, renew, release, renew.on_pg(), release.on_pg())


THREADS: Final = LogTable.of(threads)
CONVERSATIONS: Final = LogTable.of(conversations)


def leased_thread(m: Mapping[Any, Any]) -> LeasedThread:
    return LeasedThread(
        id=m["id"],
        session_id=m["session_id"],
        system=m["system"],
        tools=m["tools"],
        system_fp=m["system_fp"],
        tools_fp=m["tools_fp"],
        output_config_fp=m["output_config_fp"],
        fixed_markers=m["fixed_markers"],
        head_position=m["head_position"],
        byte_count=m["byte_count"],
        ttl_seconds=m["ttl_seconds"],
        base_position=m["base_position"],
        base_bytes=m["base_bytes"],
        head_bytes=m["head_bytes"],
        context_tokens=m["context_tokens"],
        owner=m["owner"],
        tenant_id=m["tenant_id"],
        metadata_user_id=m["metadata_user_id"],
    )


class LeaseStatements:
    """The leased log's steps, run: every kind of log's take, renew, release and commit.

    `engine`: transactions (a commit of several statements on SQLite). `single`: an engine in AUTOCOMMIT for the
    statements that are atomic by themselves, so they run without BEGIN/COMMIT round trips. `pg`: PostgreSQL's
    prepared statements, used for every statement here when given. `content`: the keys stored content is sealed under;
    a leased thread's system and tools are opened, a Responses turn sealed, as every read and write of them is (None,
    or not enabled: in clear)."""

    def __init__(
        self, engine: AsyncEngine, single: AsyncEngine, pg: PgHotPath | None, content: ContentKeys | None = None
    ) -> None:
        self._engine = engine
        self._single = single
        self._pg = pg
        self._keys = active(content)

    async def take_thread(self, take: TakeThreadByResponse | TakeThreadBySession) -> LeasedThread | None:
        row: Any
        if self._pg is not None and isinstance(take, TakeThreadByResponse):
            row = await self._pg.fetchrow(_TAKE_THREAD_BY_RESPONSE_PG, take)
        elif isinstance(take, TakeThreadByResponse):
            row = await self._single_row(TAKE_THREAD_BY_RESPONSE, take)
        else:
            row = await self._single_row(TAKE_THREAD_BY_SESSION, take)
        if row is None:
            return None
        leased = leased_thread(row)
        return leased if self._keys is None else await opened_thread(self._keys, leased)

    async def take_conversation(self, take: TakeConversation) -> tuple[int, int, int] | None:
        row: Any
        if self._pg is not None:
            row = await self._pg.fetchrow(_TAKE_CONVERSATION_PG, take)
        else:
            row = await self._single_row(TAKE_CONVERSATION, take)
        if row is None:
            return None
        return int(row["next_position"]), int(row["context_tokens"]), int(row["context_bytes"])

    async def renew(self, log: LogTable, renew: Renew) -> bool:
        if self._pg is not None:
            return await self._pg.execute(log.renew_pg, renew) == "UPDATE 1"
        async with self._single.connect() as conn:
            renewed = await conn.execute(log.renew.statement, log.renew.values(renew))
        return renewed.rowcount == 1

    async def release(self, log: LogTable, release: Release) -> None:
        if self._pg is not None:
            await self._pg.execute(log.release_pg, release)
            return
        async with self._single.connect() as conn:
            await conn.execute(log.release.statement, log.release.values(release))

    async def commit_thread_turn(self, commit: TurnCommit) -> HeadAfter | bool:
        return await commit_thread_turn(self._engine, self._pg, commit)

    async def commit_response(self, new: NewResponse, token: str | None) -> ResponseRow | None:
        """The turn stored, as a read of it would return its row; None when nothing was."""
        sealed = new if self._keys is None else seal_response(new, await self._keys.sealer(scope_of(new)))
        stored = await commit_response(self._engine, self._pg, sealed, token)
        return stored_row(new, stored) if stored is not None else None

    async def commit_append(self, append: AppendItems, items: Sequence[StoredItem]) -> bool:
        return await commit_append(self._engine, self._pg, append, items)

    async def _single_row(self, statement: CoreStatement[P], params: P) -> RowMapping | None:
        async with self._single.connect() as conn:
            row = (await conn.execute(statement.statement, statement.values(params))).first()
        return row._mapping if row is not None else None
