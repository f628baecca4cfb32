"""The SQL of stored responses: insert a turn, read one, rebuild a chain's context from stored bytes, delete."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from statestore.responses.items import StoredItem, join_rendered, join_segments
from statestore.store.schema import conversation_items, conversations, response_items, responses


@dataclass(frozen=True, slots=True)
class ResponseRow:
    id: str
    root_id: str
    depth: int
    chain_bytes: int
    body: bytes


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


class ResponseStore:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def get(self, owner: str, response_id: str, *, now_ms: int) -> ResponseRow | None:
        query = select(
            responses.c.id, responses.c.root_id, responses.c.depth, responses.c.chain_bytes, responses.c.body
        ).where(responses.c.id == response_id, responses.c.owner == owner, responses.c.expires_ms > now_ms)
        async with self.engine.connect() as conn:
            row = (await conn.execute(query)).first()
        return ResponseRow(row[0], row[1], row[2], row[3], row[4]) if row is not None else None

    async def chain_context(self, head: ResponseRow) -> bytes | None:
        """The joined Chat Completions messages of the chain ending at `head`, oldest first, from the database; None
        when an ancestor is gone (deleted, or erased)."""
        chain = (
            select(responses.c.id, responses.c.parent_id, responses.c.depth)
            .where(responses.c.id == head.id)
            .cte("chain", recursive=True)
        )
        chain = chain.union_all(
            select(responses.c.id, responses.c.parent_id, responses.c.depth).where(responses.c.id == chain.c.parent_id)
        )
        query = (
            select(chain.c.depth, response_items.c.kind, response_items.c.rendered)
            .join(response_items, response_items.c.response_id == chain.c.id)
            .order_by(chain.c.depth, response_items.c.position)
        )
        async with self.engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        segments: list[list[tuple[str, bytes]]] = [[] for _ in range(head.depth + 1)]
        seen = set()
        for depth, kind, rendered in rows:
            segments[depth].append((kind, rendered))
            seen.add(depth)
        if len(seen) != head.depth + 1:
            return None
        return join_segments(join_rendered(segment) for segment in segments)

    async def insert(self, new: NewResponse, conn: AsyncConnection) -> None:
        parent = new.parent
        await conn.execute(
            insert(responses).values(
                id=new.id,
                owner=new.owner,
                tenant_id=new.tenant_id,
                metadata_user_id=new.metadata_user_id,
                parent_id=parent.id if parent else None,
                root_id=parent.root_id if parent else new.id,
                conversation_id=new.conversation_id,
                depth=parent.depth + 1 if parent else 0,
                chain_bytes=(parent.chain_bytes if parent else 0) + new.segment_bytes,
                body=new.body,
                created_ms=new.created_ms,
                expires_ms=new.expires_ms,
            )
        )
        rows = [{**row, "is_output": False} for row in item_rows(new.inputs)]
        rows += [{**row, "is_output": True} for row in item_rows(new.outputs, len(new.inputs))]
        await conn.execute(insert(response_items), [{**row, "response_id": new.id} for row in rows])

    async def commit(self, new: NewResponse, *, conversation_lease: str | None = None) -> bool:
        """Store a completed turn in one transaction; with a conversation, append its items there and release the
        lease in the same transaction. False when the lease was lost (nothing stored)."""
        async with self.engine.begin() as conn:
            if new.conversation_id is not None:
                claimed = await conn.execute(
                    update(conversations)
                    .where(conversations.c.id == new.conversation_id, conversations.c.lease_token == conversation_lease)
                    .values(
                        next_position=conversations.c.next_position + len(new.inputs) + len(new.outputs),
                        lease_token=None,
                        lease_expires_ms=None,
                        expires_ms=new.expires_ms,
                    )
                    .returning(conversations.c.next_position)
                )
                end = claimed.scalar_one_or_none()
                if end is None:
                    await conn.rollback()
                    return False
                start = end - len(new.inputs) - len(new.outputs)
                rows = item_rows([*new.inputs, *new.outputs], start)
                await conn.execute(
                    insert(conversation_items), [{**row, "conversation_id": new.conversation_id} for row in rows]
                )
            await self.insert(new, conn)
        return True

    async def input_items(self, owner: str, response_id: str, *, now_ms: int) -> list[bytes] | None:
        query = (
            select(response_items.c.body)
            .join(responses, responses.c.id == response_items.c.response_id)
            .where(
                responses.c.id == response_id,
                responses.c.owner == owner,
                responses.c.expires_ms > now_ms,
                response_items.c.is_output.is_(False),
            )
            .order_by(response_items.c.position)
        )
        async with self.engine.connect() as conn:
            found = await self.get(owner, response_id, now_ms=now_ms)
            if found is None:
                return None
            return [row[0] for row in (await conn.execute(query)).all()]

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
