"""A Responses turn's commit (the leased log, core/leased_log.py, commits every kind of turn through here or
thread_commit.py, by store/lease_statements.py), and a conversation's append.

A chained turn inserts its response and its items (response_items); a chain has no lease, since a response may be
continued any number of times. A turn on a conversation moves the conversation's position, only if it still holds
the lease, and stores its items once, in conversation_items, with its response pointing at them (first position,
input and output counts; revision 0008).

Each step is written once, as SQLAlchemy Core. PostgreSQL runs a commit's steps as one statement compiled once for
asyncpg (one round trip, one durable flush), each later step reading the first (a CTE) and the items passed as
parallel arrays; SQLite runs the same steps as a transaction, the first step's outcome read by the next as a
subquery, and the items as rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Final

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Integer,
    LargeBinary,
    Select,
    String,
    case,
    exists,
    func,
    insert,
    literal_column,
    null,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.sql.dml import Insert
from sqlalchemy.sql.elements import ColumnClause, ColumnElement
from sqlalchemy.sql.selectable import FromClause, TableValuedAlias

from statestore.store.pg_hot_path import PgHotPath
from statestore.store.response_records import NewResponse, Stored, StoredItem
from statestore.store.response_runs import place
from statestore.store.schema import conversation_items, conversations, response_items, responses
from statestore.store.statement import CoreStatement, core_param, core_values
from statestore.store.usage_rows import count_usage, usage_key


@dataclass(slots=True, kw_only=True)
class ResponseTurnRow:
    """What every Responses turn's commit stores, whether it chains on a response or lands on a conversation: the
    response, its items as parallel arrays (PostgreSQL's one unnest inserts them all), the daily_usage row the turn
    adds to, and what the turn measured (store/response_records.py ContextRecord)."""

    id: str
    owner: str
    tenant_id: str | None
    metadata_user_id: str | None
    chain_bytes: int
    body: bytes
    created_ms: int
    expires_ms: int
    inputs: int  # the first `inputs` items are the input, the rest the output
    item_ids: list[str]
    bodies: list[bytes]
    kinds: list[str]
    rendered: list[bytes]
    # The daily_usage row (store/usage_rows.py) and the bytes the turn stores.
    usage_day: int
    usage_shard: int
    usage_bytes: int
    context_tokens: int | None
    context_bytes: int | None


@dataclass(slots=True, kw_only=True)
class InsertResponse(ResponseTurnRow):
    """A chained turn: its place in the chain, and where the next turn's context starts."""

    parent_id: str | None
    root_id: str
    depth: int
    context_kept: int | None
    context_head_id: str | None
    context_head: bytes | None
    # Where the items go (store/response_runs.py Placement): on in the parent's run, unless it is taken past the
    # parent's end, else in a run of their own; all None for none.
    extend_run: int | None
    extend_from: int | None
    extended: bytes | None
    new_run: int | None
    started: bytes | None


@dataclass(slots=True, kw_only=True)
class CommitConversationTurn(ResponseTurnRow):
    """A turn on a conversation, committed only while it holds the lease `token` (a conversation's base is its
    items: nothing else of the context is kept)."""

    conversation_id: str
    token: str | None
    count: int  # items, inputs first


@dataclass(slots=True, kw_only=True)
class AppendItems:
    """Items appended to a conversation (`POST /v1/conversations/{id}/items`), only while the append holds the lease
    `token`, its turn id: once stored, the lease is gone, so the same append carried out again stores nothing."""

    conversation_id: str
    token: str
    count: int
    item_ids: list[str]
    bodies: list[bytes]
    kinds: list[str]
    rendered: list[bytes]


# -- the steps, written once ---------------------------------------------------------------------------------------
_p = core_param
_ONE: ColumnClause[Any] = literal_column("1")

# The columns of `responses` every turn sets, chained or on a conversation.
_RESPONSE: Final[dict[str, ColumnElement[Any]]] = {
    "id": _p("id", String),
    "owner": _p("owner", String),
    "tenant_id": _p("tenant_id", String),
    "metadata_user_id": _p("metadata_user_id", String),
    "chain_bytes": _p("chain_bytes", BigInteger),
    "body": _p("body", LargeBinary),
    "created_ms": _p("created_ms", BigInteger),
    "expires_ms": _p("expires_ms", BigInteger),
    "context_tokens": _p("context_tokens", BigInteger),
    "context_bytes": _p("context_bytes", BigInteger),
}


def _insert(table: Any, columns: dict[str, ColumnElement[Any]], source: FromClause) -> Insert:
    """One row into `table`, its values read beside `source` (no row in `source`: nothing inserted)."""
    return insert(table).from_select(list(columns), select(*columns.values()).select_from(source))


def _usage(postgres: bool, after: FromClause | None = None) -> Insert:
    return count_usage(
        postgres=postgres,
        door="responses",
        day=_p("usage_day", Integer),
        shard=_p("usage_shard", Integer),
        added_bytes=_p("usage_bytes", BigInteger),
        after=after,
    )


_USAGE: Final = _usage(False)


def _items() -> TableValuedAlias:
    """The items' arrays as rows, with their ordinal (PostgreSQL)."""
    return (
        func.unnest(
            _p("item_ids", ARRAY(String)),
            _p("bodies", ARRAY(LargeBinary)),
            _p("kinds", ARRAY(String)),
            _p("rendered", ARRAY(LargeBinary)),
        )
        .table_valued("item_id", "body", "kind", "rendered", with_ordinality="ord")
        .render_derived(name="m")
    )


# A chained turn. Its placement: a row when the parent is there (or the turn is a chain's root), saying whether the
# items begin a run of their own (`fresh`): they go on in the parent's run unless something is stored past the
# parent's end there (one probe of the runs' index), else in a run of their own (store/response_runs.py). No row
# when the parent is gone (deleted while the turn ran, or read from a cache entry a deletion could not drop:
# store/response_heads.py), and then nothing is stored.
_extend_run = _p("extend_run", BigInteger)
_extend_from = _p("extend_from", Integer)
_parent_id = _p("parent_id", String)
PLACE_CHAINED: Final = select(
    or_(
        _extend_run.is_(None),
        exists().where(response_items.c.run_id == _extend_run, response_items.c.run_position >= _extend_from),
    ).label("fresh")
).where(or_(_parent_id.is_(None), exists().where(responses.c.id == _parent_id)))


def _add_chained(placed: FromClause) -> Insert:
    return _insert(
        responses,
        {
            **_RESPONSE,
            "parent_id": _parent_id,
            "root_id": _p("root_id", String),
            "conversation_id": null(),
            "depth": _p("depth", Integer),
            "context_kept": _p("context_kept", Integer),
            "context_head_id": _p("context_head_id", String),
            "context_head": _p("context_head", LargeBinary),
            "context_runs": case((placed.c.fresh, _p("started", LargeBinary)), else_=_p("extended", LargeBinary)),
        },
        placed,
    )


def _insert_chained() -> Select[Any]:
    """PostgreSQL's one statement: whether the run is new, no row when the parent is gone."""
    placed = PLACE_CHAINED.cte("placed")
    added = _add_chained(placed).returning(responses.c.id).cte("added")
    m = _items()
    ordinal = (m.c.ord - _ONE).cast(Integer)
    items = insert(response_items).from_select(
        ["response_id", "position", "is_output", "item_id", "body", "kind", "rendered", "run_id", "run_position"],
        select(
            added.c.id,
            ordinal,
            m.c.ord > _p("inputs", Integer),
            m.c.item_id,
            m.c.body,
            m.c.kind,
            m.c.rendered,
            case((placed.c.fresh, _p("new_run", BigInteger)), else_=_extend_run),
            case((placed.c.fresh, ordinal), else_=_extend_from + ordinal),
        )
        .select_from(added)
        .join(placed, true())
        .join(m, true()),
    )
    return select(placed.c.fresh).add_cte(added, _usage(True, after=added).cte("counted"), items.cte("items"))


INSERT_RESPONSE: Final = CoreStatement(InsertResponse, _insert_chained(), durable=True)
_INSERT_RESPONSE_PG: Final = INSERT_RESPONSE.on_pg()
_ADD_CHAINED_SQLITE: Final = _add_chained(PLACE_CHAINED.subquery("placed"))


# A turn or an append on a conversation: nothing happens unless it still holds the lease (:token); then its items
# take the next positions (from `start`) and the lease is given back.
_count = _p("count", Integer)
_conversation_id = _p("conversation_id", String)
_HELD = (conversations.c.id == _conversation_id, conversations.c.lease_token == _p("token", String))
_START = (conversations.c.next_position - _count).label("start")
_TURN_CLAIM: Final = (
    update(conversations)
    .where(*_HELD)
    .values(
        next_position=conversations.c.next_position + _count,
        lease_token=null(),
        lease_expires_ms=null(),
        expires_ms=_p("expires_ms", BigInteger),
        context_tokens=func.coalesce(_p("context_tokens", BigInteger), conversations.c.context_tokens),
        context_bytes=func.coalesce(_p("context_bytes", BigInteger), conversations.c.context_bytes),
    )
    .returning(_START)
)
_APPEND_CLAIM: Final = (
    update(conversations)
    .where(*_HELD)
    .values(next_position=conversations.c.next_position + _count, lease_token=null(), lease_expires_ms=null())
    .returning(_START)
)
# On SQLite, the claim's `start` as the next step reads it: after the claim, the conversation's position less the
# items.
_CLAIMED_SQLITE: Final = select(_START).where(conversations.c.id == _conversation_id).subquery("claimed")


def _add_on_conversation(claimed: FromClause) -> Insert:
    """A conversation's turn is a chain's root (a turn has a conversation or a previous response, not both), pointing
    at its items' first position."""
    return _insert(
        responses,
        {
            **_RESPONSE,
            "parent_id": null(),
            "root_id": _p("id", String),
            "conversation_id": _conversation_id,
            "conversation_position": claimed.c.start,
            "input_count": _p("inputs", Integer),
            "output_count": _count - _p("inputs", Integer),
            "depth": literal_column("0"),
        },
        claimed,
    )


def _conversation_items(claimed: FromClause) -> Insert:
    m = _items()
    return insert(conversation_items).from_select(
        ["conversation_id", "position", "item_id", "body", "kind", "rendered"],
        select(
            _conversation_id,
            claimed.c.start + (m.c.ord - _ONE).cast(Integer),
            m.c.item_id,
            m.c.body,
            m.c.kind,
            m.c.rendered,
        )
        .select_from(claimed)
        .join(m, true()),
    )


def _commit_on_conversation() -> Select[Any]:
    """PostgreSQL's one statement: the items' first position, or no row when the lease was lost."""
    claimed = _TURN_CLAIM.cte("claimed")
    return select(claimed.c.start).add_cte(
        _add_on_conversation(claimed).cte("added"),
        _conversation_items(claimed).cte("items"),
        _usage(True, after=claimed).cte("counted"),
    )


def _append() -> Select[Any]:
    """PostgreSQL's one statement: as a turn's on a conversation without a response."""
    claimed = _APPEND_CLAIM.cte("claimed")
    return select(claimed.c.start).add_cte(_conversation_items(claimed).cte("items"))


COMMIT_CONVERSATION_TURN: Final = CoreStatement(CommitConversationTurn, _commit_on_conversation(), durable=True)
_COMMIT_CONVERSATION_TURN_PG: Final = COMMIT_CONVERSATION_TURN.on_pg()
APPEND_ITEMS: Final = CoreStatement(AppendItems, _append(), durable=True)
APPEND_ITEMS_PG: Final = APPEND_ITEMS.on_pg()
_ADD_ON_CONVERSATION_SQLITE: Final = _add_on_conversation(_CLAIMED_SQLITE)


_ID, _BODY, _KIND, _RENDERED = (attrgetter(name) for name in ("item_id", "body", "kind", "rendered"))


def item_arrays(items: Sequence[StoredItem]) -> tuple[list[str], list[bytes], list[str], list[bytes]]:
    """The items' ids, bodies, kinds and renderings, as the four array parameters of a commit (each read in C)."""
    return list(map(_ID, items)), list(map(_BODY, items)), list(map(_KIND, items)), list(map(_RENDERED, items))


# -- binding and running -------------------------------------------------------------------------------------------


def item_rows(items: Sequence[StoredItem], first_position: int = 0) -> list[dict[str, Any]]:
    return [
        {
            "position": first_position + i,
            "item_id": it.item_id,
            "body": it.body,
            "kind": it.kind,
            "rendered": it.rendered,
        }
        for i, it in enumerate(items)
    ]


def _usage_of(new: NewResponse, bodies: list[bytes], rendered: list[bytes]) -> tuple[int, int, int]:
    """The daily_usage row the turn adds to (day, shard; a conversation's turns share one) and the bytes it stores:
    the response's, and its items' (`item_arrays`) bodies and renderings."""
    stored = len(new.body) + sum(map(len, bodies)) + sum(map(len, rendered))
    return (*usage_key("responses", new.created_ms, new.conversation_id or new.id), stored)


def _chained(new: NewResponse) -> InsertResponse:
    parent = new.parent
    item_ids, bodies, kinds, rendered = item_arrays([*new.inputs, *new.outputs])
    day, shard, stored = _usage_of(new, bodies, rendered)
    placement = place(
        parent.context_runs if parent else None, is_root=parent is None, response_id=new.id, count=len(item_ids)
    )
    return InsertResponse(
        id=new.id,
        owner=new.owner,
        tenant_id=new.tenant_id,
        metadata_user_id=new.metadata_user_id,
        parent_id=parent.id if parent else None,
        root_id=parent.root_id if parent else new.id,
        depth=parent.depth + 1 if parent else 0,
        chain_bytes=(parent.chain_bytes if parent else 0) + new.segment_bytes,
        body=new.body,
        created_ms=new.created_ms,
        expires_ms=new.expires_ms,
        inputs=len(new.inputs),
        item_ids=item_ids,
        bodies=bodies,
        kinds=kinds,
        rendered=rendered,
        usage_day=day,
        usage_shard=shard,
        usage_bytes=stored,
        context_tokens=new.context.tokens or None,
        context_bytes=new.context.counted_bytes or None,
        context_kept=new.context.kept,
        context_head_id=new.context.head_id,
        context_head=new.context.head,
        extend_run=placement.extend_run,
        extend_from=placement.extend_from,
        extended=placement.extended,
        new_run=placement.new_run,
        started=placement.started,
    )


def _on_conversation(new: NewResponse, conversation_id: str, token: str | None) -> CommitConversationTurn:
    item_ids, bodies, kinds, rendered = item_arrays([*new.inputs, *new.outputs])
    day, shard, stored = _usage_of(new, bodies, rendered)
    return CommitConversationTurn(
        id=new.id,
        owner=new.owner,
        tenant_id=new.tenant_id,
        metadata_user_id=new.metadata_user_id,
        conversation_id=conversation_id,
        token=token,
        chain_bytes=new.segment_bytes,
        body=new.body,
        created_ms=new.created_ms,
        expires_ms=new.expires_ms,
        count=len(item_ids),
        inputs=len(new.inputs),
        item_ids=item_ids,
        bodies=bodies,
        kinds=kinds,
        rendered=rendered,
        usage_day=day,
        usage_shard=shard,
        usage_bytes=stored,
        context_tokens=new.context.tokens or None,
        context_bytes=new.context.counted_bytes or None,
    )


async def commit_response(
    engine: AsyncEngine, pg: PgHotPath | None, new: NewResponse, token: str | None
) -> Stored | None:
    """Store a completed turn at once. On a conversation its items are appended there (only there) and the lease
    `token` released with them; None when the lease was lost, or a chained turn's parent is gone (nothing stored).
    Both databases bind from the one parameter object of the statement."""
    items = [*new.inputs, *new.outputs]
    if new.conversation_id is None:
        chained = _chained(new)
        if pg is not None:
            fresh = await pg.fetchval(_INSERT_RESPONSE_PG, chained)
        else:
            fresh = await _insert_chained_sqlite(engine, chained, items)
        if fresh is None:
            return None
        return Stored(chained.started if fresh else chained.extended)
    turn = _on_conversation(new, new.conversation_id, token)
    if pg is not None:
        start = await pg.fetchval(_COMMIT_CONVERSATION_TURN_PG, turn)
    else:
        start = await _on_conversation_sqlite(engine, turn, items, add_response=True)
    return Stored() if start is not None else None


async def commit_append(
    engine: AsyncEngine, pg: PgHotPath | None, append: AppendItems, items: Sequence[StoredItem]
) -> bool:
    """Append `items` (`append` their arrays, sealed as stored) while the append holds the conversation's lease, the
    lease released with them; False, nothing stored, when it no longer does (APPEND_ITEMS)."""
    if pg is not None:
        return await pg.fetchval(APPEND_ITEMS_PG, append) is not None
    return await _on_conversation_sqlite(engine, append, items, add_response=False) is not None


async def _insert_chained_sqlite(
    engine: AsyncEngine, chained: InsertResponse, items: Sequence[StoredItem]
) -> bool | None:
    values = core_values(chained)
    async with engine.begin() as conn:
        fresh = (await conn.execute(PLACE_CHAINED, values)).scalar_one_or_none()
        if fresh is None:
            return None
        await conn.execute(_ADD_CHAINED_SQLITE, values)
        run, first = (chained.new_run, 0) if fresh else (chained.extend_run, chained.extend_from or 0)
        rows = [
            {
                **row,
                "response_id": chained.id,
                "is_output": row["position"] >= chained.inputs,
                "run_id": run,
                "run_position": None if run is None else first + row["position"],
            }
            for row in item_rows(items)
        ]
        await conn.execute(insert(response_items), rows)
        await conn.execute(_USAGE, values)
    return bool(fresh)


async def _on_conversation_sqlite(
    engine: AsyncEngine, turn: CommitConversationTurn | AppendItems, items: Sequence[StoredItem], *, add_response: bool
) -> int | None:
    values = core_values(turn)
    async with engine.begin() as conn:
        start = (await conn.execute(_TURN_CLAIM if add_response else _APPEND_CLAIM, values)).scalar_one_or_none()
        if start is None:
            await conn.rollback()
            return None
        if add_response:
            await conn.execute(_ADD_ON_CONVERSATION_SQLITE, values)
        rows = [{**row, "conversation_id": turn.conversation_id} for row in item_rows(items, start)]
        await conn.execute(insert(conversation_items), rows)
        if add_response:
            await conn.execute(_USAGE, values)
    return int(start)
