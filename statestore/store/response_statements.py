"""The Responses front door's hot reads: the previous response, a chain's context, a conversation's items, each
written once as SQLAlchemy Core, run on PostgreSQL compiled for asyncpg as prepared statements on
store/pg_hot_path.py's pools and on SQLite through Core, bound from its typed parameter object (store/statement.py).
The conversation's lease is the leased log's (core/leased_log.py); a turn's commit and an append are
store/response_commit.py's. The cold paths are Core (store/response_store.py, conversation_store.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import asyncpg
from sqlalchemy import (
    JSON,
    BigInteger,
    Integer,
    LargeBinary,
    and_,
    case,
    cast,
    func,
    literal_column,
    null,
    select,
    union_all,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

from statestore.store.pg_hot_path import PgHotPath
from statestore.store.schema import conversation_items, conversations, response_items, responses
from statestore.store.statement import CoreStatement, core_param


@dataclass(slots=True, kw_only=True)
class GetResponse:
    response_id: str
    owner: str
    now_ms: int


@dataclass(slots=True, kw_only=True)
class OfResponse:
    response_id: str


@dataclass(slots=True, kw_only=True)
class OfConversation:
    conversation_id: str


@dataclass(slots=True, kw_only=True)
class OfRuns:
    keys: list[int]
    ends: list[int]


# Its columns named as ResponseRow's fields (store/response_records.py read_row). With the version of the
# conversation its chain began on, if it did (-1: that conversation is gone): see responses/context.py chain_count.
# Written once: PostgreSQL runs it compiled (GET_RESPONSE.pg), SQLite through Core.
_root = responses.alias("root")
_holder = responses.alias("holder")
GET_RESPONSE: Final = CoreStatement(
    GetResponse,
    select(
        responses.c.id,
        responses.c.root_id,
        responses.c.depth,
        responses.c.chain_bytes,
        responses.c.body,
        case(
            (_root.c.conversation_id.is_(None), null()),
            else_=func.coalesce(conversations.c.next_position, literal_column("-1")),
        ).label("conversation_version"),
        func.coalesce(responses.c.context_tokens, literal_column("0")).label("context_tokens"),
        func.coalesce(responses.c.context_bytes, literal_column("0")).label("context_bytes"),
        responses.c.context_kept,
        responses.c.context_head_id,
        _holder.c.context_head,
        responses.c.context_runs,
        responses.c.expires_ms,
    )
    .select_from(
        responses.outerjoin(_root, _root.c.id == responses.c.root_id)
        .outerjoin(conversations, conversations.c.id == _root.c.conversation_id)
        .outerjoin(_holder, _holder.c.id == responses.c.context_head_id)
    )
    .where(
        responses.c.id == core_param("response_id"),
        responses.c.owner == core_param("owner"),
        responses.c.expires_ms > core_param("now_ms"),
    ),
    durable=True,
)
_GET_RESPONSE_PG: Final = GET_RESPONSE.on_pg()

# A conversation's items, (kind, rendered, position) in order. Written once: PostgreSQL runs it compiled
# (LOAD_CONVERSATION.pg), SQLite through Core.
LOAD_CONVERSATION: Final = CoreStatement(
    OfConversation,
    select(conversation_items.c.kind, conversation_items.c.rendered, conversation_items.c.position)
    .where(conversation_items.c.conversation_id == core_param("conversation_id"))
    .order_by(conversation_items.c.position),
    durable=True,
)
_LOAD_CONVERSATION_PG: Final = LOAD_CONVERSATION.on_pg()
# A chain rebuilt from the database (store/response_store.py chain_segments says how it is read): every member
# once, ahead of its items, marked 'pointed' when its items are in its conversation. Rows are (depth, kind, rendered,
# id, position). Written once: PostgreSQL runs it compiled (CHAIN_CONTEXT.pg), SQLite through Core.
_walked = (responses.c.id, responses.c.parent_id, responses.c.depth, responses.c.conversation_position)
_chain = select(*_walked).where(responses.c.id == core_param("response_id")).cte("chain", recursive=True)
_chain = _chain.union_all(select(*_walked).where(responses.c.id == _chain.c.parent_id))
_members = union_all(
    select(
        _chain.c.depth,
        literal_column("-1").label("position"),
        case(
            (_chain.c.conversation_position.is_(None), literal_column("'none'")), else_=literal_column("'pointed'")
        ).label("kind"),
        cast(literal_column("''"), LargeBinary).label("rendered"),
        _chain.c.id,
    ),
    select(
        _chain.c.depth, response_items.c.position, response_items.c.kind, response_items.c.rendered, _chain.c.id
    ).join(response_items, response_items.c.response_id == _chain.c.id),
).subquery("members")
CHAIN_CONTEXT: Final = CoreStatement(
    OfResponse,
    select(_members.c.depth, _members.c.kind, _members.c.rendered, _members.c.id, _members.c.position).order_by(
        _members.c.depth, _members.c.position
    ),
    durable=True,
)
_CHAIN_CONTEXT_PG: Final = CHAIN_CONTEXT.on_pg()


# A chain's items read from its runs' prefixes (store/response_runs.py): one index range a run, in path order.
# Written once: PostgreSQL runs it compiled (RUN_ITEMS.pg), SQLite through Core. The runs come as two lists, which
# only their rows (RunRows) read per database: PostgreSQL as arrays, SQLite as JSON.
class RunRows(FunctionElement[Any]):
    """The runs as rows (run_id, run_end, ord), `ord` their order on the path, from the lists of their keys and ends.
    Rendered as a subquery on each database (PostgreSQL pulls it up: the plan is the one of an unnest in FROM)."""

    name = "run_rows"
    inherit_cache = True


# Each rendering holds nothing but the compiler's own placeholders of the two lists.
@compiles(RunRows)
def _run_rows_pg(element: RunRows, compiler: SQLCompiler, **kw: Any) -> str:
    keys, ends = (compiler.process(clause, **kw) for clause in element.clauses)
    return f"(SELECT * FROM unnest({keys}, {ends}) WITH ORDINALITY AS runs(run_id, run_end, ord))"  # noqa: S608


@compiles(RunRows, "sqlite")
def _run_rows_sqlite(element: RunRows, compiler: SQLCompiler, **kw: Any) -> str:
    # Each end read by its run's index, not from a second json_each: a join of the two would let SQLite read a run
    # ahead of the end that bounds it (by the index: the whole run, not its prefix).
    keys, ends = (compiler.process(clause, **kw) for clause in element.clauses)
    return (
        f"(SELECT runs.value AS run_id, json_extract({ends}, '$[' || runs.key || ']') AS run_end, runs.key AS ord"  # noqa: S608
        f" FROM json_each({keys}) AS runs)"
    )


_runs = (
    RunRows(
        core_param("keys", ARRAY(BigInteger).with_variant(JSON(), "sqlite")),
        core_param("ends", ARRAY(Integer).with_variant(JSON(), "sqlite")),
    )
    .table_valued("run_id", "run_end", "ord")
    .alias("p")
)
RUN_ITEMS: Final = CoreStatement(
    OfRuns,
    select(response_items.c.response_id, response_items.c.kind, response_items.c.rendered, response_items.c.position)
    .select_from(
        _runs.join(
            response_items,
            and_(response_items.c.run_id == _runs.c.run_id, response_items.c.run_position < _runs.c.run_end),
        )
    )
    .order_by(_runs.c.ord, response_items.c.run_position),
    durable=True,
)
_RUN_ITEMS_PG: Final = RUN_ITEMS.on_pg()


def in_conversation(items: Any) -> Any:
    """The conversation_items a response points at (none for a response whose items are in response_items)."""
    return and_(
        items.c.conversation_id == responses.c.conversation_id,
        items.c.position >= responses.c.conversation_position,
        items.c.position < responses.c.conversation_position + responses.c.input_count + responses.c.output_count,
    )


# The items a response made on a conversation points at there: (kind, rendered, position, conversation id) in order.
# Written once: PostgreSQL runs it compiled (POINTED_ITEMS.pg), SQLite through Core.
POINTED_ITEMS: Final = CoreStatement(
    OfResponse,
    select(
        conversation_items.c.kind,
        conversation_items.c.rendered,
        conversation_items.c.position,
        conversation_items.c.conversation_id,
    )
    .select_from(responses)
    .join(conversation_items, in_conversation(conversation_items))
    .where(responses.c.id == core_param("response_id"))
    .order_by(conversation_items.c.position),
    durable=True,
)
_POINTED_ITEMS_PG: Final = POINTED_ITEMS.on_pg()


class PgResponseStatements:
    def __init__(self, pg: PgHotPath) -> None:
        self._pg = pg

    async def get(self, get: GetResponse) -> asyncpg.Record | None:
        return await self._pg.fetchrow(_GET_RESPONSE_PG, get)

    async def chain_rows(self, head_id: str) -> list[asyncpg.Record]:
        """(depth, kind, rendered, response id, position) of the chain ending at `head_id`, as CHAIN_CONTEXT orders
        them."""
        return await self._pg.fetch(_CHAIN_CONTEXT_PG, OfResponse(response_id=head_id))

    async def run_items(self, keys: list[int], ends: list[int]) -> list[asyncpg.Record]:
        """(response id, kind, rendered, position) of the runs' prefixes, as RUN_ITEMS orders them."""
        return await self._pg.fetch(_RUN_ITEMS_PG, OfRuns(keys=keys, ends=ends))

    async def pointed_items(self, response_id: str) -> list[asyncpg.Record]:
        """(kind, rendered, position, conversation id) of the items a response made on a conversation points at."""
        return await self._pg.fetch(_POINTED_ITEMS_PG, OfResponse(response_id=response_id))

    async def conversation_items(self, conversation_id: str) -> list[asyncpg.Record]:
        """(kind, rendered, position) of a conversation's items, in order."""
        return await self._pg.fetch(_LOAD_CONVERSATION_PG, OfConversation(conversation_id=conversation_id))
