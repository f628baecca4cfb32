"""A Responses turn's commit (store/leased_log.py commits every kind of turn through here or thread_commit.py).

A chained turn inserts its response and its items (response_items); a chain has no lease, since a response may be
continued any number of times. A turn on a conversation moves the conversation's position, only if it still holds
the lease, and stores its items once, in conversation_items, with its response pointing at them (first position,
input and output counts; revision 0008). On PostgreSQL one prepared statement, one round trip, one durable flush
(store/response_statements.py); on SQLite a transaction of Core statements.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import insert, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from statestore.store.pg_hot_path import PgHotPath
from statestore.store.response_records import NewResponse, StoredItem
from statestore.store.response_statements import (
    COMMIT_CONVERSATION_TURN,
    INSERT_RESPONSE,
    CommitConversationTurn,
    InsertResponse,
    item_arrays,
)
from statestore.store.schema import conversation_items, conversations, response_items, responses


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
    }
    if new.conversation_id is not None:
        values["input_count"], values["output_count"] = len(new.inputs), len(new.outputs)
    return values


async def commit_response(engine: AsyncEngine, pg: PgHotPath | None, new: NewResponse, token: str | None) -> bool:
    """Store a completed turn at once. On a conversation its items are appended there (only there) and the lease
    `token` released with them; False when the lease was lost (nothing stored)."""
    if pg is not None:
        return await _pg_commit(pg, new, token)
    async with engine.begin() as conn:
        if new.conversation_id is None:
            await _insert_chained(conn, new)
            return True
        count = len(new.inputs) + len(new.outputs)
        claimed = await conn.execute(
            update(conversations)
            .where(conversations.c.id == new.conversation_id, conversations.c.lease_token == token)
            .values(
                next_position=conversations.c.next_position + count,
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
        await conn.execute(insert(responses).values(**_response_values(new), conversation_position=end - count))
        rows = item_rows([*new.inputs, *new.outputs], end - count)
        await conn.execute(
            insert(conversation_items), [{**row, "conversation_id": new.conversation_id} for row in rows]
        )
    return True


async def _insert_chained(conn: AsyncConnection, new: NewResponse) -> None:
    """A turn not on a conversation: the response and its own items."""
    await conn.execute(insert(responses).values(**_response_values(new)))
    rows = [{**row, "is_output": False} for row in item_rows(new.inputs)]
    rows += [{**row, "is_output": True} for row in item_rows(new.outputs, len(new.inputs))]
    await conn.execute(insert(response_items), [{**row, "response_id": new.id} for row in rows])


async def _pg_commit(pg: PgHotPath, new: NewResponse, token: str | None) -> bool:
    items = [*new.inputs, *new.outputs]
    item_ids, bodies, kinds, rendered = item_arrays(items)
    if new.conversation_id is None:
        parent = new.parent
        await pg.execute(
            INSERT_RESPONSE,
            InsertResponse(
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
            ),
        )
        return True
    # The turn's first position in the conversation, or no row when the lease was lost.
    start = await pg.fetchval(
        COMMIT_CONVERSATION_TURN,
        CommitConversationTurn(
            id=new.id,
            owner=new.owner,
            tenant_id=new.tenant_id,
            metadata_user_id=new.metadata_user_id,
            conversation_id=new.conversation_id,
            token=token,
            chain_bytes=new.segment_bytes,
            body=new.body,
            created_ms=new.created_ms,
            expires_ms=new.expires_ms,
            count=len(items),
            inputs=len(new.inputs),
            item_ids=item_ids,
            bodies=bodies,
            kinds=kinds,
            rendered=rendered,
        ),
    )
    return start is not None
