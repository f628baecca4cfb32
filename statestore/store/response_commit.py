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

from sqlalchemy import exists, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.sql.dml import Insert

from statestore.store.pg_hot_path import PgHotPath
from statestore.store.response_records import NewResponse, Stored, StoredItem
from statestore.store.response_runs import place
from statestore.store.response_statements import (
    COMMIT_CONVERSATION_TURN,
    INSERT_RESPONSE,
    CommitConversationTurn,
    InsertResponse,
    ResponseTurnRow,
    item_arrays,
)
from statestore.store.schema import conversation_items, conversations, response_items, responses
from statestore.store.usage_rows import count_usage, usage_key


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


def _usage(new: NewResponse, bodies: list[bytes], rendered: list[bytes]) -> tuple[int, int, int]:
    """The daily_usage row the turn adds to (day, shard; a conversation's turns share one) and the bytes it stores:
    the response's, and its items' (`item_arrays`) bodies and renderings."""
    stored = len(new.body) + sum(map(len, bodies)) + sum(map(len, rendered))
    return (*usage_key("responses", new.created_ms, new.conversation_id or new.id), stored)


def _chained(new: NewResponse) -> InsertResponse:
    parent = new.parent
    item_ids, bodies, kinds, rendered = item_arrays([*new.inputs, *new.outputs])
    day, shard, stored = _usage(new, bodies, rendered)
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
    """A conversation's turn is a chain's root (a turn has a conversation or a previous response, not both)."""
    item_ids, bodies, kinds, rendered = item_arrays([*new.inputs, *new.outputs])
    day, shard, stored = _usage(new, bodies, rendered)
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
    Both dialects bind from the one parameter object of the statement."""
    if new.conversation_id is None:
        chained = _chained(new)
        if pg is not None:
            # Whether the items began a run of their own (INSERT_RESPONSE's placement); no row: the parent is gone.
            fresh = await pg.fetchval(INSERT_RESPONSE, chained)
            if fresh is None:
                return None
            return Stored(chained.started if fresh else chained.extended)
        async with engine.begin() as conn:
            stored = await _insert_chained(conn, chained, [*new.inputs, *new.outputs])
            if stored is not None:
                await conn.execute(_count_usage(engine, chained.usage_day, chained.usage_shard, chained.usage_bytes))
        return stored
    turn = _on_conversation(new, new.conversation_id, token)
    if pg is not None:
        # The turn's first position in the conversation, or no row when the lease was lost.
        return Stored() if await pg.fetchval(COMMIT_CONVERSATION_TURN, turn) is not None else None
    async with engine.begin() as conn:
        claimed = await conn.execute(
            update(conversations)
            .where(conversations.c.id == turn.conversation_id, conversations.c.lease_token == turn.token)
            .values(
                next_position=conversations.c.next_position + turn.count,
                lease_token=None,
                lease_expires_ms=None,
                expires_ms=turn.expires_ms,
                context_tokens=func.coalesce(turn.context_tokens, conversations.c.context_tokens),
                context_bytes=func.coalesce(turn.context_bytes, conversations.c.context_bytes),
            )
            .returning(conversations.c.next_position)
        )
        end = claimed.scalar_one_or_none()
        if end is None:
            await conn.rollback()
            return None
        start = end - turn.count
        await conn.execute(
            insert(responses).values(
                **_response_values(turn),
                parent_id=None,
                root_id=turn.id,
                conversation_id=turn.conversation_id,
                conversation_position=start,
                input_count=turn.inputs,
                output_count=turn.count - turn.inputs,
                depth=0,
            )
        )
        rows = item_rows([*new.inputs, *new.outputs], start)
        await conn.execute(
            insert(conversation_items), [{**row, "conversation_id": turn.conversation_id} for row in rows]
        )
        await conn.execute(_count_usage(engine, turn.usage_day, turn.usage_shard, turn.usage_bytes))
    return Stored()


def _count_usage(engine: AsyncEngine, day: int, shard: int, stored: int) -> Insert:
    postgres = engine.dialect.name == "postgresql"
    return count_usage(postgres=postgres, door="responses", day=day, shard=shard, added_bytes=stored)


def _response_values(turn: ResponseTurnRow) -> dict[str, Any]:
    """The columns of `responses` every turn sets, chained or on a conversation."""
    return {
        "id": turn.id,
        "owner": turn.owner,
        "tenant_id": turn.tenant_id,
        "metadata_user_id": turn.metadata_user_id,
        "chain_bytes": turn.chain_bytes,
        "body": turn.body,
        "created_ms": turn.created_ms,
        "expires_ms": turn.expires_ms,
        "context_tokens": turn.context_tokens,
        "context_bytes": turn.context_bytes,
    }


async def _insert_chained(conn: AsyncConnection, chained: InsertResponse, items: Sequence[StoredItem]) -> Stored | None:
    """A turn not on a conversation: the response and its own items, inputs first, placed in a run as
    INSERT_RESPONSE places them; None, with nothing stored, when the parent is gone."""
    if chained.parent_id is not None:
        parent = exists().where(responses.c.id == chained.parent_id)
        if not (await conn.execute(select(parent))).scalar_one():
            return None
    run, first, runs = chained.new_run, 0, chained.started
    if chained.extend_run is not None and chained.extend_from is not None:
        taken = exists().where(
            response_items.c.run_id == chained.extend_run, response_items.c.run_position >= chained.extend_from
        )
        if not (await conn.execute(select(taken))).scalar_one():
            run, first, runs = chained.extend_run, chained.extend_from, chained.extended
    await conn.execute(
        insert(responses).values(
            **_response_values(chained),
            parent_id=chained.parent_id,
            root_id=chained.root_id,
            conversation_id=None,
            depth=chained.depth,
            context_kept=chained.context_kept,
            context_head_id=chained.context_head_id,
            context_head=chained.context_head,
            context_runs=runs,
        )
    )
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
    return Stored(runs)
