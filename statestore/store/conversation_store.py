"""The SQL of conversations: rows, items, and the lease a turn holds so that two turns never interleave items.

`next_position` is also the conversation's version: every change of its items moves it (a turn, an append, a
deletion), so a cached context that records the position it was made at is current exactly when the position matches
(responses/context.py). The lease, its renewal and release are the leased log's (store/leased_log.py); SQLAlchemy
Core here, and on PostgreSQL the context read runs as an asyncpg prepared statement (store/response_statements.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

from sqlalchemy import ColumnElement, and_, delete, insert, or_, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from statestore.store.leased_log import CONVERSATIONS, LeasedLog, Release, Renew, TakeConversation
from statestore.store.response_commit import item_rows
from statestore.store.response_records import ConversationRow, StoredItem
from statestore.store.response_statements import PgResponseStatements
from statestore.store.schema import conversation_items, conversations


class Locked(Exception):
    """Another turn holds the conversation."""


class ConversationStore:
    def __init__(self, engine: AsyncEngine, log: LeasedLog, pg: PgResponseStatements | None = None) -> None:
        self.engine = engine
        self.log = log
        self._pg = pg

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
        return ConversationRow(row[0], row[1], row[2]) if row is not None else None

    async def update_metadata(
        self, owner: str, conversation_id: str, *, metadata: bytes, user_id: str | None, now_ms: int
    ) -> bool:
        async with self.engine.begin() as conn:
            changed = await conn.execute(
                update(conversations)
                .where(*self._mine(owner, conversation_id, now_ms))
                .values(metadata=metadata, metadata_user_id=user_id)
            )
        return changed.rowcount > 0

    async def delete(self, owner: str, conversation_id: str, *, now_ms: int) -> bool:
        async with self.engine.begin() as conn:
            deleted = await conn.execute(delete(conversations).where(*self._mine(owner, conversation_id, now_ms)))
        return deleted.rowcount > 0

    async def lease(
        self, owner: str, conversation_id: str, *, token: str, now_ms: int, until_ms: int
    ) -> tuple[int, int, int]:
        """Take the conversation for one turn: its next position, and the backend's token count of its last turn
        with the bytes it counted (0, 0 before any); raises Locked, or LookupError when there is no such
        conversation."""
        leased = await self.log.take_conversation(
            TakeConversation(
                conversation_id=conversation_id, owner=owner, now_ms=now_ms, token=token, until_ms=until_ms
            )
        )
        if leased is None:
            await self._refuse(owner, conversation_id, now_ms)
        return leased

    async def _refuse(self, owner: str, conversation_id: str, now_ms: int) -> NoReturn:
        """Why the conversation could not be taken: Locked, or LookupError. Only on the refusal path."""
        async with self.engine.connect() as conn:
            exists = (
                await conn.execute(select(conversations.c.id).where(*self._mine(owner, conversation_id, now_ms)))
            ).first()
        raise Locked() if exists is not None else LookupError(conversation_id)

    async def renew(self, conversation_id: str, token: str, *, until_ms: int) -> bool:
        """Extend a turn's lease; False when it was lost."""
        return await self.log.renew(CONVERSATIONS, Renew(log_id=conversation_id, token=token, until_ms=until_ms))

    async def release(self, conversation_id: str, token: str) -> None:
        await self.log.release(CONVERSATIONS, Release(log_id=conversation_id, token=token))

    async def context_items(self, conversation_id: str) -> list[tuple[str, bytes]]:
        """The (kind, rendering) of every item, in order (responses/context.py joins them)."""
        if self._pg is not None:
            return await self._pg.conversation_items(conversation_id)
        query = (
            select(conversation_items.c.kind, conversation_items.c.rendered)
            .where(conversation_items.c.conversation_id == conversation_id)
            .order_by(conversation_items.c.position)
        )
        async with self.engine.connect() as conn:
            return [(row[0], row[1]) for row in (await conn.execute(query)).all()]

    async def append(self, owner: str, conversation_id: str, items: Sequence[StoredItem], *, now_ms: int) -> None:
        """Append items unless a turn holds the conversation (Locked) or it does not exist (LookupError)."""
        async with self.engine.begin() as conn:
            claimed = await conn.execute(
                update(conversations)
                .where(*self._mine(owner, conversation_id, now_ms), self._free(now_ms))
                # A lease that ran out is taken over: the turn that held it can no longer commit on stale context.
                .values(
                    next_position=conversations.c.next_position + len(items), lease_token=None, lease_expires_ms=None
                )
                .returning(conversations.c.next_position)
            )
            end = claimed.scalar_one_or_none()
            if end is None:
                exists = (
                    await conn.execute(select(conversations.c.id).where(*self._mine(owner, conversation_id, now_ms)))
                ).first()
                raise Locked() if exists is not None else LookupError(conversation_id)
            rows = [{**row, "conversation_id": conversation_id} for row in item_rows(items, end - len(items))]
            await conn.execute(insert(conversation_items), rows)

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
            query = select(conversation_items.c.body).where(and_(*where)).order_by(order).limit(limit + 1)
            bodies = [row[0] for row in (await conn.execute(query)).all()]
        return bodies[:limit], len(bodies) > limit

    async def item(self, owner: str, conversation_id: str, item_id: str, *, now_ms: int) -> bytes | None:
        query = (
            select(conversation_items.c.body)
            .join(conversations, conversations.c.id == conversation_items.c.conversation_id)
            .where(*self._mine(owner, conversation_id, now_ms), conversation_items.c.item_id == item_id)
            .order_by(conversation_items.c.position)
            .limit(1)
        )
        async with self.engine.connect() as conn:
            return (await conn.execute(query)).scalar()

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
