"""The SQL of stored responses: insert a turn, read one, rebuild a chain's context from stored bytes, delete.

A chained turn's items are in response_items; a turn on a conversation stores its items once, in conversation_items,
and its response points at them (first position, input and output counts; revision 0008). SQLAlchemy Core here; on
PostgreSQL the hot statements (get, commit) run as asyncpg prepared statements (responses/pg_statements.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import and_, case, delete, func, insert, literal, null, select, union_all, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from statestore.responses.items import StoredItem, join_rendered, join_segments
from statestore.responses.pg_statements import PgResponseStatements
from statestore.responses.records import ContextRecord
from statestore.store.schema import conversation_items, conversations, response_items, responses


@dataclass(frozen=True, slots=True)
class ResponseRow:
    id: str
    root_id: str
    depth: int
    chain_bytes: int
    body: bytes
    # The chain began on a conversation's response: that conversation's version (its next position, moved by every
    # change of its items; -1 once it is gone) as this row was read. None for a chain of its own.
    conversation_version: int | None = None
    # PROTOCOL §9 (responses/context.py ChainBase): what the backend counted of this turn, and where the context
    # the next turn starts from begins.
    context_tokens: int = 0
    context_bytes: int = 0
    context_kept: int | None = None
    context_head_id: str | None = None
    context_head: bytes | None = None


@dataclass(frozen=True, slots=True)
class NewResponse:
    id: str
    owner: str
    tenant_id: str | None
    metadata_user_id: str | None
    parent: ResponseRow | None
    conversation_id: str | None
    segment_bytes: int
    body: bytes
    created_ms: int
    expires_ms: int
    inputs: Sequence[StoredItem]
    outputs: Sequence[StoredItem]
    context: ContextRecord = field(default_factory=ContextRecord)


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


_POINTED = "pointed"  # a chain member whose items are in its conversation (pg_statements.CHAIN_CONTEXT says it too)


def _in_conversation(items: Any) -> Any:
    """The conversation_items a response points at (none for a response whose items are in response_items)."""
    return and_(
        items.c.conversation_id == responses.c.conversation_id,
        items.c.position >= responses.c.conversation_position,
        items.c.position < responses.c.conversation_position + responses.c.input_count + responses.c.output_count,
    )


class ResponseStore:
    def __init__(self, engine: AsyncEngine, pg: PgResponseStatements | None = None) -> None:
        self.engine = engine
        self._pg = pg

    async def get(self, owner: str, response_id: str, *, now_ms: int) -> ResponseRow | None:
        if self._pg is not None:
            record = await self._pg.get(owner, response_id, now_ms)
            return ResponseRow(*record) if record is not None else None
        root = responses.alias("root")
        holder = responses.alias("holder")
        version = case(
            (root.c.conversation_id.is_(None), null()), else_=func.coalesce(conversations.c.next_position, -1)
        )
        query = (
            select(
                responses.c.id,
                responses.c.root_id,
                responses.c.depth,
                responses.c.chain_bytes,
                responses.c.body,
                version,
                func.coalesce(responses.c.context_tokens, 0),
                func.coalesce(responses.c.context_bytes, 0),
                responses.c.context_kept,
                responses.c.context_head_id,
                holder.c.context_head,
            )
            .select_from(
                responses.outerjoin(root, root.c.id == responses.c.root_id)
                .outerjoin(conversations, conversations.c.id == root.c.conversation_id)
                .outerjoin(holder, holder.c.id == responses.c.context_head_id)
            )
            .where(responses.c.id == response_id, responses.c.owner == owner, responses.c.expires_ms > now_ms)
        )
        async with self.engine.connect() as conn:
            row = (await conn.execute(query)).first()
        return ResponseRow(*row) if row is not None else None

    async def chain_context(self, head: ResponseRow) -> bytes | None:
        """The joined Chat Completions messages of the chain ending at `head`, oldest first, from the database; None
        when an ancestor is gone (deleted, or erased). A response made on a conversation (only ever a chain's root)
        reads its items from the conversation: an item deleted there is gone from its context too."""
        # Every member of the chain once, ahead of its items, so that a missing ancestor shows as a missing depth in
        # the same query; a member whose items are in its conversation is marked, and they are read apart (rare).
        # On PostgreSQL a prepared statement (pg_statements.CHAIN_CONTEXT), else the same query through Core.
        rows = await self._pg.chain_rows(head.id) if self._pg is not None else await self._chain_rows(head.id)
        segments: list[list[tuple[str, bytes]]] = [[] for _ in range(head.depth + 1)]
        seen = set()
        for depth, kind, rendered in rows:
            seen.add(depth)
            if kind == _POINTED:
                # Only a root is made on a conversation (a turn has a conversation or a previous response).
                segments[depth] = await self._pointed_items(head.root_id)
            else:
                segments[depth].append((kind, rendered))
        if len(seen) != head.depth + 1:
            return None
        return join_segments(join_rendered(segment) for segment in segments)

    async def _chain_rows(self, head_id: str) -> list[Any]:
        walked = (responses.c.id, responses.c.parent_id, responses.c.depth, responses.c.conversation_position)
        chain = select(*walked).where(responses.c.id == head_id).cte("chain", recursive=True)
        chain = chain.union_all(select(*walked).where(responses.c.id == chain.c.parent_id))
        marker = case((chain.c.conversation_position.is_(None), literal("none")), else_=literal(_POINTED))
        members = select(chain.c.depth, literal(-1), marker, literal(b""))
        own = select(chain.c.depth, response_items.c.position, response_items.c.kind, response_items.c.rendered).join(
            response_items, response_items.c.response_id == chain.c.id
        )
        both = union_all(members, own).subquery()
        query = select(both.c[0], both.c[2], both.c[3]).order_by(both.c[0], both.c[1])
        async with self.engine.connect() as conn:
            return list((await conn.execute(query)).all())

    async def _pointed_items(self, response_id: str) -> list[tuple[str, bytes]]:
        if self._pg is not None:
            return await self._pg.pointed_items(response_id)
        pointed = (
            select(conversation_items.c.kind, conversation_items.c.rendered)
            .select_from(responses)
            .join(conversation_items, _in_conversation(conversation_items))
            .where(responses.c.id == response_id)
            .order_by(conversation_items.c.position)
        )
        async with self.engine.connect() as conn:
            return [(row[0], row[1]) for row in (await conn.execute(pointed)).all()]

    @staticmethod
    def _response_values(new: NewResponse) -> dict[str, Any]:
        parent = new.parent
        values: dict[str, Any] = {
            "id": new.id,
            "owner": new.owner,
            "tenant_id": new.tenant_id,
            "metadata_user_id": new.metadata_user_id,
            "parent_id": parent.id if parent else None,
            "root_id": parent.root_id if parent else new.id,
            "conversation_id": new.conversation_id,
            "depth": parent.depth + 1 if parent else 0,
            "chain_bytes": (parent.chain_bytes if parent else 0) + new.segment_bytes,
            "body": new.body,
            "created_ms": new.created_ms,
            "expires_ms": new.expires_ms,
            "context_tokens": new.context.tokens or None,
            "context_bytes": new.context.counted_bytes or None,
            "context_kept": new.context.kept,
            "context_head_id": new.context.head_id,
            "context_head": new.context.head,
        }
        if new.conversation_id is not None:
            values["input_count"], values["output_count"] = len(new.inputs), len(new.outputs)
        return values

    async def insert(self, new: NewResponse, conn: AsyncConnection) -> None:
        """A turn not on a conversation: the response and its own items."""
        await conn.execute(insert(responses).values(**self._response_values(new)))
        rows = [{**row, "is_output": False} for row in item_rows(new.inputs)]
        rows += [{**row, "is_output": True} for row in item_rows(new.outputs, len(new.inputs))]
        await conn.execute(insert(response_items), [{**row, "response_id": new.id} for row in rows])

    async def commit(self, new: NewResponse, *, conversation_lease: str | None = None) -> int | None:
        """Store a completed turn in one transaction. On a conversation its items are appended there (only there)
        and the lease released in the same transaction; returns the conversation's next position after the turn
        (0 for a turn not on a conversation), or None when the lease was lost (nothing stored)."""
        if self._pg is not None:
            return await self._pg_commit(self._pg, new, conversation_lease)
        async with self.engine.begin() as conn:
            if new.conversation_id is None:
                await self.insert(new, conn)
                return 0
            count = len(new.inputs) + len(new.outputs)
            claimed = await conn.execute(
                update(conversations)
                .where(conversations.c.id == new.conversation_id, conversations.c.lease_token == conversation_lease)
                .values(
                    next_position=conversations.c.next_position + count,
                    lease_token=None,
                    lease_expires_ms=None,
                    expires_ms=new.expires_ms,
                    context_tokens=func.coalesce(new.context.tokens or None, conversations.c.context_tokens),
                    context_bytes=func.coalesce(new.context.counted_bytes or None, conversations.c.context_bytes),
                )
                .returning(conversations.c.next_position)
            )
            end = claimed.scalar_one_or_none()
            if end is None:
                await conn.rollback()
                return None
            await conn.execute(
                insert(responses).values(**self._response_values(new), conversation_position=end - count)
            )
            rows = item_rows([*new.inputs, *new.outputs], end - count)
            await conn.execute(
                insert(conversation_items), [{**row, "conversation_id": new.conversation_id} for row in rows]
            )
        return int(end)

    @staticmethod
    async def _pg_commit(pg: PgResponseStatements, new: NewResponse, lease: str | None) -> int | None:
        items = [*new.inputs, *new.outputs]
        if new.conversation_id is None:
            values = ResponseStore._response_values(new)
            await pg.insert_response(
                *(values[k] for k in ("id", "owner", "tenant_id", "metadata_user_id", "parent_id", "root_id")),
                *(values[k] for k in ("depth", "chain_bytes", "body", "created_ms", "expires_ms")),
                inputs=len(new.inputs),
                items=items,
                context=new.context,
            )
            return 0
        start = await pg.commit_conversation_turn(
            new.id,
            new.owner,
            new.tenant_id,
            new.metadata_user_id,
            new.conversation_id,
            lease,
            new.segment_bytes,
            new.body,
            new.created_ms,
            new.expires_ms,
            inputs=len(new.inputs),
            items=items,
            context=new.context,
        )
        return None if start is None else start + len(items)

    async def input_items(self, owner: str, response_id: str, *, now_ms: int) -> list[bytes] | None:
        """The response's input item bodies, from wherever they are stored; None when there is no such response."""
        found = select(responses.c.conversation_position, responses.c.input_count).where(
            responses.c.id == response_id, responses.c.owner == owner, responses.c.expires_ms > now_ms
        )
        async with self.engine.connect() as conn:
            row = (await conn.execute(found)).first()
            if row is None:
                return None
            if row[0] is None:
                query = (
                    select(response_items.c.body)
                    .where(response_items.c.response_id == response_id, response_items.c.is_output.is_(False))
                    .order_by(response_items.c.position)
                )
            else:
                query = (
                    select(conversation_items.c.body)
                    .select_from(responses)
                    .join(conversation_items, _in_conversation(conversation_items))
                    .where(
                        responses.c.id == response_id,
                        conversation_items.c.position < responses.c.conversation_position + responses.c.input_count,
                    )
                    .order_by(conversation_items.c.position)
                )
            return [item[0] for item in (await conn.execute(query)).all()]

    async def delete(self, owner: str, response_id: str, *, now_ms: int) -> list[str] | None:
        """Delete one of the owner's live responses. Returns the ids of its tree (whose cached contexts may hold its
        items), or None when there was no such response."""
        async with self.engine.begin() as conn:
            root = (
                await conn.execute(
                    select(responses.c.root_id).where(
                        responses.c.id == response_id, responses.c.owner == owner, responses.c.expires_ms > now_ms
                    )
                )
            ).scalar_one_or_none()
            if root is None:
                return None
            tree = [row[0] for row in (await conn.execute(select(responses.c.id).where(responses.c.root_id == root)))]
            await conn.execute(delete(responses).where(responses.c.id == response_id))
        return tree
