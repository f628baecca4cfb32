"""The SQL of stored responses: commit a turn (through the leased log), read one, read a chain's stored items for a
rebuild, delete.

A chained turn's items are in response_items; a turn on a conversation stores its items once, in conversation_items,
and its response points at them (first position, input and output counts; revision 0008). SQLAlchemy Core here; on
PostgreSQL the hot statements (get, the chain's items, commit) run as asyncpg prepared statements
(store/response_statements.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import and_, case, delete, func, literal, null, select, union_all
from sqlalchemy.ext.asyncio import AsyncEngine

from statestore.store.leased_log import LeasedLog
from statestore.store.response_records import NewResponse, ResponseRow
from statestore.store.response_runs import Row, Runs, decode, segments_of
from statestore.store.response_statements import GetResponse, PgResponseStatements
from statestore.store.schema import conversation_items, conversations, response_items, responses

# A chain member whose items are in its conversation (response_statements.CHAIN_CONTEXT says it too).
_POINTED = "pointed"


def _in_conversation(items: Any) -> Any:
    """The conversation_items a response points at (none for a response whose items are in response_items)."""
    return and_(
        items.c.conversation_id == responses.c.conversation_id,
        items.c.position >= responses.c.conversation_position,
        items.c.position < responses.c.conversation_position + responses.c.input_count + responses.c.output_count,
    )


class ResponseStore:
    def __init__(self, engine: AsyncEngine, log: LeasedLog, pg: PgResponseStatements | None = None) -> None:
        self.engine = engine
        self.log = log
        self._pg = pg

    async def get(self, owner: str, response_id: str, *, now_ms: int) -> ResponseRow | None:
        if self._pg is not None:
            record = await self._pg.get(GetResponse(response_id=response_id, owner=owner, now_ms=now_ms))
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
                responses.c.context_runs,
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

    async def chain_segments(self, head: ResponseRow) -> list[list[tuple[str, bytes]]] | None:
        """The (kind, rendering) of the items of each response of the chain ending at `head`, oldest first, from the
        database (responses/context.py joins them); None when an ancestor is gone (deleted, or erased). A response
        made on a conversation (only ever a chain's root) reads its items from the conversation: an item deleted
        there is gone from its context too.

        A chain whose head knows its runs (store/response_runs.py) reads exactly its items, in one indexed read
        whatever its depth; when that read is not exactly the path (an ancestor deleted, a run taken twice), or the
        head has no runs (stored before revision 0013, or begun on a conversation), the parents are walked."""
        if head.context_runs is not None:
            runs = decode(head.context_runs)
            found = segments_of(runs, await self._run_items(runs), head.depth)
            if found is not None:
                return found
        # Every member of the chain once, ahead of its items, so that a missing ancestor shows as a missing depth in
        # the same query; a member whose items are in its conversation is marked, and they are read apart (rare).
        # On PostgreSQL a prepared statement (response_statements.CHAIN_CONTEXT), else the same query through Core.
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
        return segments

    async def _run_items(self, runs: Runs) -> Sequence[Row]:
        if self._pg is not None:
            return await self._pg.run_items(runs.keys, runs.ends)
        prefixes = [
            select(
                literal(order).label("run_order"),
                response_items.c.run_position,
                response_items.c.response_id,
                response_items.c.kind,
                response_items.c.rendered,
            ).where(response_items.c.run_id == key, response_items.c.run_position < end)
            for order, (key, end) in enumerate(runs.runs)
        ]
        both = union_all(*prefixes).subquery()
        query = select(both.c.response_id, both.c.kind, both.c.rendered).order_by(both.c.run_order, both.c.run_position)
        async with self.engine.connect() as conn:
            return (await conn.execute(query)).all()

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

    async def commit(self, new: NewResponse, *, conversation_lease: str | None = None) -> bool:
        """Store a completed turn (store/response_commit.py): False when it was on a conversation whose lease this
        turn no longer held (nothing stored), as for every leased log."""
        return await self.log.commit_response(new, conversation_lease)

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
