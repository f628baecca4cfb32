"""The deletions of retention: one owner's thread, expired threads (purge), and erasure by tenant or user."""

from __future__ import annotations

from sqlalchemy import delete, or_, select
from sqlalchemy.ext.asyncio import AsyncEngine

from statestore.store.schema import threads
from statestore.store.thread_reads import live


class RetentionQueries:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def delete_thread(self, owner: str, thread_id: str, *, now_ms: int) -> tuple[bool, bool]:
        """Erase one thread of the owner's (its messages and session binding go by cascade). Returns (whether it was
        live, whether anything was deleted): an expired one is deleted all the same, another owner's never."""
        async with self.engine.begin() as conn:
            was_live = (
                await conn.execute(select(threads.c.id).where(threads.c.id == thread_id, live(owner, now_ms)))
            ).first()
            deleted = await conn.execute(delete(threads).where(threads.c.id == thread_id, threads.c.owner == owner))
        return was_live is not None, deleted.rowcount > 0

    async def purge_expired(self, *, now_ms: int, batch_size: int) -> list[str]:
        """Delete one batch of expired threads that no request holds; returns their ids. Short transactions, and
        concurrent purgers in other processes skip each other's rows."""
        doomed = (
            select(threads.c.id)
            .where(
                threads.c.expires_ms <= now_ms,
                or_(threads.c.lease_token.is_(None), threads.c.lease_expires_ms <= now_ms),
            )
            .order_by(threads.c.expires_ms)
            .limit(batch_size)
            .with_for_update(skip_locked=True)
        )
        async with self.engine.begin() as conn:
            ids = [row[0] for row in (await conn.execute(doomed)).all()]
            if ids:
                await conn.execute(delete(threads).where(threads.c.id.in_(ids)))
        return ids

    async def erase_batch(
        self, *, batch_size: int, tenant_id: str | None = None, user_id: str | None = None, owner: str | None = None
    ) -> list[str]:
        """Delete one batch of the threads matching every given criterion, live or not; returns their ids."""
        criteria = []
        if tenant_id is not None:
            criteria.append(threads.c.tenant_id == tenant_id)
        if user_id is not None:
            criteria.append(threads.c.metadata_user_id == user_id)
        if owner is not None:
            criteria.append(threads.c.owner == owner)
        if not criteria:
            raise ValueError("erasure needs at least one criterion")
        chosen = select(threads.c.id).where(*criteria).limit(batch_size).with_for_update(skip_locked=True)
        async with self.engine.begin() as conn:
            ids = [row[0] for row in (await conn.execute(chosen)).all()]
            if ids:
                await conn.execute(delete(threads).where(threads.c.id.in_(ids)))
        return ids
