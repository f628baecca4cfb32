"""The SQL of conversations: rows, items, and the lease a turn holds so that two turns never interleave items.

`next_position` is also the conversation's version: every change of its items moves it (a turn, an append, a
deletion), so a cached context that records the position it was made at is current exactly when the position matches
(responses/context.py). The lease, its renewal and release are the leased log's (core/leased_log.py); here, why a
take was refused. SQLAlchemy Core here, and on PostgreSQL the context read runs as an asyncpg prepared statement
(store/response_statements.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import ColumnElement, and_, delete, func, insert, or_, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from statestore.content_keys import ContentKeys, Scope
from statestore.store.response_commit import AppendItems, item_arrays, item_rows
from statestore.store.response_records import ConversationRow, StoredItem
from statestore.store.response_sealing import active, conversation_data, conversation_item_data, seal_items
from statestore.store.response_statements import LOAD_CONVERSATION, OfConversation, PgResponseStatements
from statestore.store.schema import conversation_items, conversations


class Locked(Exception):
    """Another turn holds the conversation."""


class ConversationStore:
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

    async def _opened_items(
        self, owner: str, conversation_id: str, rows: Sequence[Sequence[Any]], *, at: int, column: str
    ) -> list[bytes]:
        """The column at `at` of item rows whose next column is the position, opened (as read when off)."""
        if self._keys is None:
            return [row[at] for row in rows]
        data = [conversation_item_data(owner, conversation_id, row[at + 1], column) for row in rows]
        return await self._keys.open_many([row[at] for row in rows], data, row=f"conversations:{conversation_id}")

    @staticmethod
    def _mine(owner: str, conversation_id: str, now_ms: int) -> list[ColumnElement[bool]]:
        return [
            conversations.c.id == conversation_id,
            conversations.c.owner == owner,
            conversations.c.expires_ms > now_ms,
        ]

    @staticmethod
    def _free(now_ms: int) -> ColumnElement[bool]:
        return or_(conversations.c.lease_token.is_(None), conversations.c.lease_expires_ms <= now_ms)

    async def create(
        self,
        *,
        conversation_id: str,
        owner: str,
        tenant_id: str | None,
        metadata_user_id: str | None,
        metadata: bytes,
        items: Sequence[StoredItem],
        now_ms: int,
        expires_ms: int,
    ) -> None:
        if self._keys is not None:
            sealer = await self._keys.sealer(Scope(owner, tenant_id, metadata_user_id))
            metadata = sealer.seal(metadata, conversation_data(owner, conversation_id))
            items = seal_items(sealer, items, owner, conversation_id, 0, conversation=True)
        async with self.engine.begin() as conn:
            await conn.execute(
                insert(conversations).values(
                    id=conversation_id,
                    owner=owner,
                    tenant_id=tenant_id,
                    metadata_user_id=metadata_user_id,
                    metadata=metadata,
                    next_position=len(items),
                    created_ms=now_ms,
                    expires_ms=expires_ms,
                )
            )
            if items:
                rows = [{**row, "conversation_id": conversation_id} for row in item_rows(items)]
                await conn.execute(insert(conversation_items), rows)

    async def get(self, owner: str, conversation_id: str, *, now_ms: int) -> ConversationRow | None:
        query = select(conversations.c.id, conversations.c.metadata, conversations.c.created_ms).where(
            *self._mine(owner, conversation_id, now_ms)
        )
        async with self.engine.connect() as conn:
            row = (await conn.execute(query)).first()
        if row is None:
            return None
        metadata = row[1]
        if self._keys is not None:
            metadata = await self._keys.open(metadata, conversation_data(owner, conversation_id), row=row[0])
        return ConversationRow(row[0], metadata, row[2])

    async def user_id(self, owner: str, conversation_id: str, *, now_ms: int) -> str | None:
        """The conversation's `metadata.user_id` (None too when there is no such conversation): what its erasure is
        by, for what is kept of a write to it (an Idempotency-Key's outcome)."""
        scope = await self._scope(owner, conversation_id, now_ms)
        return None if scope is None else scope.user_id

    async def update_metadata(
        self, owner: str, conversation_id: str, *, metadata: bytes, user_id: str | None, now_ms: int
    ) -> bool:
        if self._keys is not None:
            scope = await self._scope(owner, conversation_id, now_ms, user_id=user_id)
            if scope is None:
                return False
            sealer = await self._keys.sealer(scope)
            metadata = sealer.seal(metadata, conversation_data(owner, conversation_id))
        async with self.engine.begin() as conn:
            changed = await conn.execute(
                update(conversations)
                .where(*self._mine(owner, conversation_id, now_ms))
                .values(metadata=metadata, metadata_user_id=user_id)
            )
        return changed.rowcount > 0

    async def _scope(
        self, owner: str, conversation_id: str, now_ms: int, *, user_id: str | bool | None = False
    ) -> Scope | None:
        """The conversation's erasure scope (with `user_id` for its user id when one is being set); None: no such
        conversation. Read apart from the write it seals for, so a data key made on first use is never made inside
        that write's transaction (on SQLite the key store may share its database)."""
        query = select(conversations.c.tenant_id, conversations.c.metadata_user_id).where(
            *self._mine(owner, conversation_id, now_ms)
        )
        async with self.engine.connect() as conn:
            row = (await conn.execute(query)).first()
        if row is None:
            return None
        return Scope(owner, row[0], row[1] if isinstance(user_id, bool) else user_id)

    async def delete(self, owner: str, conversation_id: str, *, now_ms: int) -> bool:
        async with self.engine.begin() as conn:
            deleted = await conn.execute(delete(conversations).where(*self._mine(owner, conversation_id, now_ms)))
        return deleted.rowcount > 0

    async def refusal(self, owner: str, conversation_id: str, now_ms: int) -> Locked | LookupError:
        """Why the leased log could not take the conversation: Locked (another turn holds it), or LookupError (no such
        conversation). Only on the refusal path."""
        async with self.engine.connect() as conn:
            exists = (
                await conn.execute(select(conversations.c.id).where(*self._mine(owner, conversation_id, now_ms)))
            ).first()
        return Locked() if exists is not None else LookupError(conversation_id)

    async def context_state(self, owner: str, conversation_id: str, *, now_ms: int) -> tuple[int, int, int] | None:
        """What the leased log's `take_conversation` returns, read without the lease (a token count takes nothing): the
        next position, and the backend's token count of the last turn with the bytes it counted; None when there is no
        such conversation."""
        query = select(
            conversations.c.next_position,
            func.coalesce(conversations.c.context_tokens, 0),
            func.coalesce(conversations.c.context_bytes, 0),
        ).where(*self._mine(owner, conversation_id, now_ms))
        async with self.engine.connect() as conn:
            row = (await conn.execute(query)).first()
        return (row[0], row[1], row[2]) if row is not None else None

    async def context_items(self, owner: str, conversation_id: str) -> list[tuple[str, bytes]]:
        """The (kind, rendering) of every item, in order (responses/context.py joins them), read by one statement
        (response_statements.LOAD_CONVERSATION): on PostgreSQL compiled for asyncpg, else through Core."""
        rows: Sequence[Sequence[Any]]
        if self._pg is not None:
            rows = await self._pg.conversation_items(conversation_id)
        else:
            of = OfConversation(conversation_id=conversation_id)
            async with self.engine.connect() as conn:
                rows = (await conn.execute(LOAD_CONVERSATION.statement, LOAD_CONVERSATION.values(of))).all()
        if self._keys is None:
            return [(row[0], row[1]) for row in rows]
        opened = await self._opened_items(owner, conversation_id, rows, at=1, column="rendered")
        return [(row[0], value) for row, value in zip(rows, opened, strict=True)]

    async def append_of(
        self, owner: str, conversation_id: str, items: Sequence[StoredItem], *, token: str, position: int
    ) -> tuple[AppendItems, Sequence[StoredItem]] | None:
        """An append of `items` as the leased log commits it (core/leased_log.py `commit_append`), sealed as they will
        be stored: `token` the append's turn id, `position` what `take_conversation` returned. None when the
        conversation was deleted meanwhile (sealing reads its scope)."""
        if self._keys is not None:
            scope = await self._scope(owner, conversation_id, 0)
            if scope is None:
                return None
            sealer = await self._keys.sealer(scope)
            items = seal_items(sealer, items, owner, conversation_id, position, conversation=True)
        item_ids, bodies, kinds, rendered = item_arrays(items)
        append = AppendItems(
            conversation_id=conversation_id,
            token=token,
            count=len(items),
            item_ids=item_ids,
            bodies=bodies,
            kinds=kinds,
            rendered=rendered,
        )
        return append, items

    async def holds_append(self, conversation_id: str, *, position: int, item_id: str) -> bool:
        """Whether an append whose items begin at `position` with `item_id` was stored: after its commit's answer was
        lost and its lease given back (which waits out a commit still running in the database)."""
        query = select(conversation_items.c.position).where(
            conversation_items.c.conversation_id == conversation_id,
            conversation_items.c.position == position,
            conversation_items.c.item_id == item_id,
        )
        async with self.engine.connect() as conn:
            return (await conn.execute(query)).first() is not None

    async def items(
        self, owner: str, conversation_id: str, *, now_ms: int, descending: bool, after: str | None, limit: int
    ) -> tuple[list[bytes], bool] | None:
        """A page of item bodies and whether more follow; None when there is no such conversation."""
        async with self.engine.connect() as conn:
            if (
                await conn.execute(select(conversations.c.id).where(*self._mine(owner, conversation_id, now_ms)))
            ).first() is None:
                return None
            where = [conversation_items.c.conversation_id == conversation_id]
            if after is not None:
                anchor = (
                    await conn.execute(
                        select(conversation_items.c.position).where(
                            conversation_items.c.conversation_id == conversation_id,
                            conversation_items.c.item_id == after,
                        )
                    )
                ).scalar()
                if anchor is not None:
                    where.append(
                        conversation_items.c.position < anchor if descending else conversation_items.c.position > anchor
                    )
            order = conversation_items.c.position.desc() if descending else conversation_items.c.position
            query = (
                select(conversation_items.c.body, conversation_items.c.position)
                .where(and_(*where))
                .order_by(order)
                .limit(limit + 1)
            )
            rows = (await conn.execute(query)).all()
        bodies = await self._opened_items(owner, conversation_id, rows[:limit], at=0, column="body")
        return bodies, len(rows) > limit

    async def item(self, owner: str, conversation_id: str, item_id: str, *, now_ms: int) -> bytes | None:
        query = (
            select(conversation_items.c.body, conversation_items.c.position)
            .join(conversations, conversations.c.id == conversation_items.c.conversation_id)
            .where(*self._mine(owner, conversation_id, now_ms), conversation_items.c.item_id == item_id)
            .order_by(conversation_items.c.position)
            .limit(1)
        )
        async with self.engine.connect() as conn:
            row = (await conn.execute(query)).first()
        return (
            None if row is None else (await self._opened_items(owner, conversation_id, [row], at=0, column="body"))[0]
        )

    async def delete_item(self, owner: str, conversation_id: str, item_id: str, *, now_ms: int) -> bool:
        """Delete an item (refused as Locked while a turn holds the conversation). The position moves on by one, a
        new version of the conversation, so a context cached before the deletion no longer matches it; a lease that
        ran out is taken over, so the turn that held it cannot commit on a context that still had the item."""
        async with self.engine.begin() as conn:
            claimed = await conn.execute(
                update(conversations)
                .where(*self._mine(owner, conversation_id, now_ms), self._free(now_ms))
                .values(next_position=conversations.c.next_position + 1, lease_token=None, lease_expires_ms=None)
                .returning(conversations.c.id)
            )
            if claimed.first() is None:
                exists = (
                    await conn.execute(select(conversations.c.id).where(*self._mine(owner, conversation_id, now_ms)))
                ).first()
                if exists is not None:
                    raise Locked()
                return False
            deleted = await conn.execute(
                delete(conversation_items).where(
                    conversation_items.c.conversation_id == conversation_id, conversation_items.c.item_id == item_id
                )
            )
            if deleted.rowcount == 0:
                await conn.rollback()
                return False
        return True
