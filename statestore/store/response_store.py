"""The SQL of stored responses: read one, read a chain's stored items for a rebuild, delete. A turn is committed
through the leased log (core/leased_log.py, store/response_commit.py).

A chained turn's items are in response_items; a turn on a conversation stores its items once, in conversation_items,
and its response points at them (first position, input and output counts; revision 0008). SQLAlchemy Core here; on
PostgreSQL the hot statements (get, the chain's items, commit) run as asyncpg prepared statements
(store/response_statements.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncEngine

from statestore.content_keys import CLEAR, ContentKeys, ContentSealer
from statestore.store.response_records import Columns, NewResponse, ResponseRow, read_row
from statestore.store.response_runs import Row, Runs, decode, segments_of
from statestore.store.response_sealing import (
    active,
    conversation_item_data,
    response_data,
    response_item_data,
    scope_of,
)
from statestore.store.response_statements import (
    CHAIN_CONTEXT,
    GET_RESPONSE,
    POINTED_ITEMS,
    RUN_ITEMS,
    GetResponse,
    OfResponse,
    OfRuns,
    PgResponseStatements,
    in_conversation,
)
from statestore.store.schema import conversation_items, response_items, responses

# A chain member whose items are in its conversation (response_statements.CHAIN_CONTEXT says it too).
_POINTED = "pointed"


class ResponseStore:
    def __init__(
        self,
        engine: AsyncEngine,
        pg: PgResponseStatements | None = None,
        content: ContentKeys | None = None,
    ) -> None:
        """`content`: the keys stored content is sealed under (store/response_sealing.py); None or off: in clear."""
        self.engine = engine
        self._pg = pg
        self._keys = active(content)

    async def sealer_for(self, new: NewResponse) -> ContentSealer:
        """What the turn's cache entries are sealed with: its rows' scope, or nothing when encryption is off."""
        return CLEAR if self._keys is None else await self._keys.sealer(scope_of(new))

    async def get(self, owner: str, response_id: str, *, now_ms: int) -> ResponseRow | None:
        found = await self._get(owner, response_id, now_ms=now_ms)
        if found is None:
            return None
        row = read_row(found, owner)
        if self._keys is None:
            return row
        values, data = [row.body], [response_data(owner, row.id, "body")]
        if row.context_head is not None and row.context_head_id is not None:
            values.append(row.context_head)
            data.append(response_data(owner, row.context_head_id, "head"))
        opened = await self._keys.open_many(values, data, row=f"responses:{row.id}")
        head = opened[1] if len(opened) > 1 else row.context_head
        return dataclasses.replace(row, body=opened[0], context_head=head)

    async def _get(self, owner: str, response_id: str, *, now_ms: int) -> Columns | None:
        if self._pg is not None:
            return await self._pg.get(GetResponse(response_id=response_id, owner=owner, now_ms=now_ms))
        get = GetResponse(response_id=response_id, owner=owner, now_ms=now_ms)
        async with self.engine.connect() as conn:
            found = (await conn.execute(GET_RESPONSE.statement, GET_RESPONSE.values(get))).first()
        return None if found is None else found._mapping

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
            read = await self._run_items(runs)
            if self._keys is not None:
                read = await self._opened(read, head.owner, at=2, id_at=0, position_at=3)
            found = segments_of(runs, read, head.depth)
            if found is not None:
                return found
        # Every member of the chain once, ahead of its items, so that a missing ancestor shows as a missing depth in
        # the same query; a member whose items are in its conversation is marked, and they are read apart (rare).
        # One statement (response_statements.CHAIN_CONTEXT): on PostgreSQL compiled for asyncpg, else through Core.
        rows: Sequence[Row]
        rows = await self._pg.chain_rows(head.id) if self._pg is not None else await self._chain_rows(head.id)
        if self._keys is not None:
            rows = await self._opened(rows, head.owner, at=2, id_at=3, position_at=4)
        segments: list[list[tuple[str, bytes]]] = [[] for _ in range(head.depth + 1)]
        seen = set()
        for row in rows:
            depth, kind = row[0], row[1]
            seen.add(depth)
            if kind == _POINTED:
                # Only a root is made on a conversation (a turn has a conversation or a previous response).
                segments[depth] = await self._pointed_items(head.root_id, head.owner)
            else:
                segments[depth].append((kind, row[2]))
        if len(seen) != head.depth + 1:
            return None
        return segments

    async def _opened(self, rows: Sequence[Row], owner: str, *, at: int, id_at: int, position_at: int) -> list[Row]:
        """`rows` with the response item rendering at `at` opened: one key lookup for them all, then a tight loop
        (a rebuild opens every item of the chain once; a rendering is bound to its response id and position)."""
        assert self._keys is not None
        data = [response_item_data(owner, row[id_at], row[position_at], "rendered") for row in rows]
        opened = await self._keys.open_many([row[at] for row in rows], data, row=f"response_items:{owner}")
        return [(*row[:at], value, *row[at + 1 :]) for row, value in zip(rows, opened, strict=True)]

    async def _run_items(self, runs: Runs) -> Sequence[Row]:
        # One statement (response_statements.RUN_ITEMS): on PostgreSQL compiled for asyncpg, else through Core.
        if self._pg is not None:
            return await self._pg.run_items(runs.keys, runs.ends)
        of = OfRuns(keys=runs.keys, ends=runs.ends)
        async with self.engine.connect() as conn:
            return (await conn.execute(RUN_ITEMS.statement, RUN_ITEMS.values(of))).all()

    async def _chain_rows(self, head_id: str) -> list[Any]:
        of = OfResponse(response_id=head_id)
        async with self.engine.connect() as conn:
            return list((await conn.execute(CHAIN_CONTEXT.statement, CHAIN_CONTEXT.values(of))).all())

    async def _pointed_items(self, response_id: str, owner: str) -> list[tuple[str, bytes]]:
        rows: Sequence[Row]
        if self._pg is not None:
            rows = await self._pg.pointed_items(response_id)
        else:
            of = OfResponse(response_id=response_id)
            async with self.engine.connect() as conn:
                rows = (await conn.execute(POINTED_ITEMS.statement, POINTED_ITEMS.values(of))).all()
        if self._keys is None:
            return [(row[0], row[1]) for row in rows]
        data = [conversation_item_data(owner, row[3], row[2], "rendered") for row in rows]
        opened = await self._keys.open_many([row[1] for row in rows], data, row=f"responses:{response_id}")
        return [(row[0], value) for row, value in zip(rows, opened, strict=True)]

    async def user_id(self, owner: str, response_id: str, *, now_ms: int) -> str | None:
        """The response's `metadata.user_id` (None too when there is no such live response): what its erasure is by,
        for what is kept of a write that continues it (an Idempotency-Key's outcome). Only keyed writes ask."""
        query = select(responses.c.metadata_user_id).where(
            responses.c.id == response_id, responses.c.owner == owner, responses.c.expires_ms > now_ms
        )
        async with self.engine.connect() as conn:
            found = (await conn.execute(query)).first()
        return None if found is None else found[0]

    async def is_stored(self, response_id: str) -> bool:
        """Whether the response was stored, a commit of it still running in the database waited out first: the read
        is an insert of the same id, which waits on the primary key until that commit ends and is rolled back (it
        stores nothing). After a commit whose answer was lost, so that its settling (core/lost_commit.py) reads an
        outcome no commit still on its way can change."""
        insert = postgresql.insert if self.engine.dialect.name == "postgresql" else sqlite.insert
        probe = (
            insert(responses)
            .values(
                id=response_id,
                owner="",
                root_id=response_id,
                depth=0,
                chain_bytes=0,
                body=b"",
                created_ms=0,
                expires_ms=0,
            )
            .on_conflict_do_nothing(index_elements=[responses.c.id])
            .returning(responses.c.id)
        )
        async with self.engine.connect() as conn:
            placed = (await conn.execute(probe)).first()
            await conn.rollback()
        return placed is None

    async def input_items(self, owner: str, response_id: str, *, now_ms: int) -> list[bytes] | None:
        """The response's input item bodies, from wherever they are stored; None when there is no such response."""
        found = select(responses.c.conversation_position, responses.c.input_count, responses.c.conversation_id).where(
            responses.c.id == response_id, responses.c.owner == owner, responses.c.expires_ms > now_ms
        )
        async with self.engine.connect() as conn:
            row = (await conn.execute(found)).first()
            if row is None:
                return None
            if row[0] is None:
                query = (
                    select(response_items.c.body, response_items.c.position)
                    .where(response_items.c.response_id == response_id, response_items.c.is_output.is_(False))
                    .order_by(response_items.c.position)
                )
            else:
                query = (
                    select(conversation_items.c.body, conversation_items.c.position)
                    .select_from(responses)
                    .join(conversation_items, in_conversation(conversation_items))
                    .where(
                        responses.c.id == response_id,
                        conversation_items.c.position < responses.c.conversation_position + responses.c.input_count,
                    )
                    .order_by(conversation_items.c.position)
                )
            items = (await conn.execute(query)).all()
        if self._keys is None:
            return [item[0] for item in items]
        if row[0] is None:
            data = [response_item_data(owner, response_id, item[1], "body") for item in items]
        else:
            data = [conversation_item_data(owner, row[2], item[1], "body") for item in items]
        return await self._keys.open_many([item[0] for item in items], data, row=f"responses:{response_id}")

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
