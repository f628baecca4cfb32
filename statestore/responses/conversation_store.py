"""The SQL of conversations: rows, items, and the lease a turn holds so that two turns never interleave items."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import ColumnElement, and_, delete, insert, or_, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from statestore.responses.items import StoredItem, join_rendered
from statestore.responses.store import item_rows
from statestore.store.schema import conversation_items, conversations


@dataclass(frozen=True, slots=True)
class ConversationRow:
    id: str
    metadata: bytes
    created_ms: int


class Locked(Exception):
    """Another turn holds the conversation."""


class ConversationStore:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

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

    async def lease(self, owner: str, conversation_id: str, *, token: str, now_ms: int, until_ms: int) -> None:
        """Take the conversation for one turn; raises Locked, or LookupError when there is no such conversation."""
        async with self.engine.begin() as conn:
            taken = await conn.execute(
                update(conversations)
                .where(*self._mine(owner, conversation_id, now_ms), self._free(now_ms))
                .values(lease_token=token, lease_expires_ms=until_ms)
            )
            if taken.rowcount == 0:
                exists = (
                    await conn.execute(select(conversations.c.id).where(*self._mine(owner, conversation_id, now_ms)))
                ).first()
                raise Locked() if exists is not None else LookupError(conversation_id)

    async def renew(self, conversation_id: str, token: str, *, until_ms: int) -> bool:
        """Extend a turn's lease; False when it was lost."""
        async with self.engine.begin() as conn:
            renewed = await conn.execute(
                update(conversations)
                .where(conversations.c.id == conversation_id, conversations.c.lease_token == token)
                .values(lease_expires_ms=until_ms)
            )
        return renewed.rowcount > 0

    async def release(self, conversation_id: str, token: str) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(
                update(conversations)
                .where(conversations.c.id == conversation_id, conversations.c.lease_token == token)
                .values(lease_token=None, lease_expires_ms=None)
            )

    async def context(self, conversation_id: str) -> bytes:
        query = (
            select(conversation_items.c.kind, conversation_items.c.rendered)
            .where(conversation_items.c.conversation_id == conversation_id)
            .order_by(conversation_items.c.position)
        )
        async with self.engine.connect() as conn:
            return join_rendered((row[0], row[1]) for row in (await conn.execute(query)).all())

    async def append(self, owner: str, conversation_id: str, items: Sequence[StoredItem], *, now_ms: int) -> None:
        """Append items unless a turn holds the conversation (Locked) or it does not exist (LookupError)."""
        async with self.engine.begin() as conn:
            claimed = await conn.execute(
                update(conversations)
                .where(*self._mine(owner, conversation_id, now_ms), self._free(now_ms))
                .values(next_position=conversations.c.next_position + len(items))
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
        """Delete an item (refused as Locked while a turn holds the conversation)."""
        async with self.engine.begin() as conn:
            row = (
                await conn.execute(
                    select(conversations.c.lease_token, conversations.c.lease_expires_ms)
                    .where(*self._mine(owner, conversation_id, now_ms))
                    .with_for_update()
                )
            ).first()
            if row is None:
                return False
            if row[0] is not None and row[1] > now_ms:
                raise Locked()
            deleted = await conn.execute(
                delete(conversation_items).where(
                    conversation_items.c.conversation_id == conversation_id, conversation_items.c.item_id == item_id
                )
            )
        return deleted.rowcount > 0
