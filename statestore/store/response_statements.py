"""The Responses front door's hot path on PostgreSQL, below SQLAlchemy: the statements every turn runs, as asyncpg
prepared statements on store/pg_hot_path.py's pools, each bound from its typed parameter object
(store/statement.py). The conversation's lease is the leased log's (store/leased_log.py). SQLAlchemy Core keeps
SQLite and every cold path (store/response_store.py, conversation_store.py, response_commit.py).

A turn's commit is one statement, one round trip, one durable flush: the response and its items; on a conversation,
the conditional move of its position (the lease's check), the response and the items, which are stored once, in
conversation_items, with the response pointing at them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Final

import asyncpg
from sqlalchemy import LargeBinary, and_, case, cast, func, literal_column, null, select, union_all

from statestore.store.pg_hot_path import PgHotPath
from statestore.store.response_records import StoredItem
from statestore.store.schema import conversation_items, conversations, response_items, responses
from statestore.store.statement import CoreStatement, PgStatement, core_param


@dataclass(slots=True, kw_only=True)
class GetResponse:
    response_id: str
    owner: str
    now_ms: int


@dataclass(slots=True, kw_only=True)
class ResponseTurnRow:
    """What every Responses turn's commit stores, whether it chains on a response or lands on a conversation: the
    response, its items as parallel arrays (one unnest inserts them all), the daily_usage row the turn adds to, and
    what the turn measured (store/response_records.py ContextRecord)."""

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

# A chained turn: the response, then its items (inputs first: an ordinal past :inputs is an output), in the parent's
# run unless something is stored past the parent's end there (one probe of the runs' index), else in a run of their
# own (store/response_runs.py). Nothing is stored, and no row returned, when the parent is gone (deleted while the turn
# ran, or read from a cache entry a deletion could not drop: store/response_heads.py); else whether the run is new.
INSERT_RESPONSE: Final = PgStatement(
    InsertResponse,
    """
WITH placed AS (
    SELECT :extend_run::bigint IS NULL OR EXISTS (
        SELECT 1 FROM response_items WHERE run_id = :extend_run::bigint AND run_position >= :extend_from::integer
    ) AS fresh
    WHERE :parent_id::varchar IS NULL OR EXISTS (SELECT 1 FROM responses WHERE id = :parent_id::varchar)
), added AS (
    INSERT INTO responses (id, owner, tenant_id, metadata_user_id, parent_id, root_id, conversation_id, depth,
        chain_bytes, body, created_ms, expires_ms, context_tokens, context_bytes, context_kept, context_head_id,
        context_head, context_runs)
    SELECT :id, :owner, :tenant_id, :metadata_user_id, :parent_id, :root_id, NULL, :depth, :chain_bytes, :body,
        :created_ms, :expires_ms, :context_tokens, :context_bytes, :context_kept, :context_head_id, :context_head,
        CASE WHEN placed.fresh THEN :started::bytea ELSE :extended::bytea END
    FROM placed
    RETURNING id
), counted AS (
    INSERT INTO daily_usage (day, shard, door, turns, bytes)
    SELECT :usage_day, :usage_shard, 'responses', 1, :usage_bytes FROM added
    ON CONFLICT (day, shard) DO UPDATE
    SET turns = daily_usage.turns + 1, bytes = daily_usage.bytes + EXCLUDED.bytes
), items AS (
    INSERT INTO response_items (response_id, position, is_output, item_id, body, kind, rendered, run_id,
        run_position)
    SELECT added.id, (m.ord - 1)::integer, m.ord > :inputs, m.item_id, m.body, m.kind, m.rendered,
        CASE WHEN placed.fresh THEN :new_run::bigint ELSE :extend_run::bigint END,
        CASE WHEN placed.fresh THEN (m.ord - 1)::integer ELSE :extend_from::integer + (m.ord - 1)::integer END
    FROM added, placed, unnest(:item_ids::varchar[], :bodies::bytea[], :kinds::varchar[], :rendered::bytea[])
        WITH ORDINALITY AS m(item_id, body, kind, rendered, ord)
)
SELECT fresh FROM placed
""",
    durable=True,
)

# A turn on a conversation: nothing happens unless the turn still holds the lease (:token); then its items take the
# next positions and the response points at the first of them. Returns that position, or no row (the lease was lost).
COMMIT_CONVERSATION_TURN: Final = PgStatement(
    CommitConversationTurn,
    """
WITH claimed AS (
    UPDATE conversations SET next_position = next_position + :count, lease_token = NULL, lease_expires_ms = NULL,
        expires_ms = :expires_ms, context_tokens = coalesce(:context_tokens, context_tokens),
        context_bytes = coalesce(:context_bytes, context_bytes)
    WHERE id = :conversation_id AND lease_token = :token
    RETURNING next_position - :count AS start
), added AS (
    INSERT INTO responses (id, owner, tenant_id, metadata_user_id, parent_id, root_id, conversation_id,
        conversation_position, input_count, output_count, depth, chain_bytes, body, created_ms, expires_ms,
        context_tokens, context_bytes)
    SELECT :id, :owner, :tenant_id, :metadata_user_id, NULL, :id, :conversation_id, claimed.start, :inputs,
        :count - :inputs, 0, :chain_bytes, :body, :created_ms, :expires_ms, :context_tokens, :context_bytes
    FROM claimed
), items AS (
    INSERT INTO conversation_items (conversation_id, position, item_id, body, kind, rendered)
    SELECT :conversation_id, claimed.start + (m.ord - 1)::integer, m.item_id, m.body, m.kind, m.rendered
    FROM claimed, unnest(:item_ids::varchar[], :bodies::bytea[], :kinds::varchar[], :rendered::bytea[])
        WITH ORDINALITY AS m(item_id, body, kind, rendered, ord)
), counted AS (
    INSERT INTO daily_usage (day, shard, door, turns, bytes)
    SELECT :usage_day, :usage_shard, 'responses', 1, :usage_bytes FROM claimed
    ON CONFLICT (day, shard) DO UPDATE
    SET turns = daily_usage.turns + 1, bytes = daily_usage.bytes + EXCLUDED.bytes
)
SELECT start FROM claimed
""",
    durable=True,
)

# An append's commit, as a turn's on a conversation (COMMIT_CONVERSATION_TURN) without a response: the items' first
# position, or no row when the append no longer holds the lease.
APPEND_ITEMS: Final = PgStatement(
    AppendItems,
    """
WITH claimed AS (
    UPDATE conversations SET next_position = next_position + :count, lease_token = NULL, lease_expires_ms = NULL
    WHERE id = :conversation_id AND lease_token = :token
    RETURNING next_position - :count AS start
), items AS (
    INSERT INTO conversation_items (conversation_id, position, item_id, body, kind, rendered)
    SELECT :conversation_id, claimed.start + (m.ord - 1)::integer, m.item_id, m.body, m.kind, m.rendered
    FROM claimed, unnest(:item_ids::varchar[], :bodies::bytea[], :kinds::varchar[], :rendered::bytea[])
        WITH ORDINALITY AS m(item_id, body, kind, rendered, ord)
)
SELECT start FROM claimed
""",
    durable=True,
)

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
# A chain's items read from its runs' prefixes (store/response_runs.py): one index range a run, in path order. The
# lateral join keeps each run's read on the runs' index, whatever the planner thinks of the arrays.
RUN_ITEMS: Final = PgStatement(
    OfRuns,
    """
SELECT i.response_id, i.kind, i.rendered, i.position
FROM unnest(:keys::bigint[], :ends::integer[]) WITH ORDINALITY AS p(run_id, run_end, ord)
CROSS JOIN LATERAL (
    SELECT response_id, kind, rendered, position, run_position FROM response_items
    WHERE run_id = p.run_id AND run_position < p.run_end
) AS i
ORDER BY p.ord, i.run_position
""",
    durable=True,
)


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


_ID, _BODY, _KIND, _RENDERED = (attrgetter(name) for name in ("item_id", "body", "kind", "rendered"))


def item_arrays(items: Sequence[StoredItem]) -> tuple[list[str], list[bytes], list[str], list[bytes]]:
    """The items' ids, bodies, kinds and renderings, as the four array parameters of a commit (each read in C)."""
    return list(map(_ID, items)), list(map(_BODY, items)), list(map(_KIND, items)), list(map(_RENDERED, items))


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
        return await self._pg.fetch(RUN_ITEMS, OfRuns(keys=keys, ends=ends))

    async def pointed_items(self, response_id: str) -> list[asyncpg.Record]:
        """(kind, rendered, position, conversation id) of the items a response made on a conversation points at."""
        return await self._pg.fetch(_POINTED_ITEMS_PG, OfResponse(response_id=response_id))

    async def conversation_items(self, conversation_id: str) -> list[asyncpg.Record]:
        """(kind, rendered, position) of a conversation's items, in order."""
        return await self._pg.fetch(_LOAD_CONVERSATION_PG, OfConversation(conversation_id=conversation_id))

    async def append_items(self, append: AppendItems) -> int | None:
        """The first position of the items appended (APPEND_ITEMS); None when the lease was no longer held."""
        start: int | None = await self._pg.fetchval(APPEND_ITEMS, append)
        return start
