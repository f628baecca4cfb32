"""The deletions of retention: one owner's thread, expired threads (purge), and erasure by tenant or user; and the
count of what an erasure would delete, from the same criteria."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Table, delete, func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from statestore.store.background_statements import OPEN
from statestore.store.schema import background_responses, conversation_items, conversations, responses, threads
from statestore.store.thread_reads import live


@dataclass(frozen=True, slots=True)
class Erasure:
    """What an erasure deletes, or would delete now: threads, responses (whole trees) and conversations."""

    threads: int
    responses: int
    conversations: int


@dataclass(frozen=True, slots=True)
class ErasedResponses:
    """One batch of an erasure of responses: the responses deleted (whole trees), and the conversations whose items
    some of them had brought (those items went too, so those conversations' cached contexts must go)."""

    response_ids: list[str]
    conversation_ids: list[str]


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

    async def count_erasable(self, *, tenant_id: str | None, user_id: str | None) -> Erasure:
        """What `erase_batch`, `erase_responses_batch` and `erase_conversations_batch` with these criteria would delete
        now, live or not: a confirmation shows it."""
        trees = select(responses.c.root_id).where(*_criteria(responses, tenant_id, user_id))
        counts = (
            select(func.count()).select_from(threads).where(*_criteria(threads, tenant_id, user_id)),
            select(func.count()).select_from(responses).where(responses.c.root_id.in_(trees)),
            select(func.count()).select_from(conversations).where(*_criteria(conversations, tenant_id, user_id)),
        )
        async with self.engine.connect() as conn:
            found = [int((await conn.execute(count)).scalar_one()) for count in counts]
        return Erasure(threads=found[0], responses=found[1], conversations=found[2])

    # -- the Responses front door: responses go by tree (a tree is kept while any of its responses is live, since
    # -- each holds items its descendants' contexts are made of), conversations one by one.

    async def purge_expired_responses(self, *, now_ms: int, batch_size: int) -> list[str]:
        """Delete the responses of a batch of trees whose every response has expired; returns their ids. Expired
        background turns that ended go with them (a completed one's content is its response's)."""
        async with self.engine.begin() as conn:
            await conn.execute(
                delete(background_responses).where(
                    background_responses.c.expires_ms <= now_ms, background_responses.c.status.not_in(OPEN)
                )
            )
        trees = (
            select(responses.c.root_id)
            .group_by(responses.c.root_id)
            .having(func.max(responses.c.expires_ms) <= now_ms)
            .limit(batch_size)
        )
        return await self._delete_trees(trees)

    async def _delete_trees(self, trees: Any) -> list[str]:
        return (await self._delete_trees_erasing(trees, None)).response_ids

    async def _delete_trees_erasing(self, trees: Any, criteria: list[Any] | None) -> ErasedResponses:
        """Delete the trees; with `criteria`, the items that their responses matching them brought into a
        conversation go too (a turn on a conversation stores its items only there, and the conversation need not
        match: a user's words in someone else's conversation are still theirs)."""
        async with self.engine.begin() as conn:
            roots = [row[0] for row in (await conn.execute(trees)).all()]
            if not roots:
                return ErasedResponses([], [])
            ids = [row[0] for row in (await conn.execute(select(responses.c.id).where(responses.c.root_id.in_(roots))))]
            touched: list[str] = []
            if criteria is not None:
                touched = await _erase_brought_items(conn, roots, criteria)
            await conn.execute(delete(responses).where(responses.c.root_id.in_(roots)))
        return ErasedResponses(ids, touched)

    async def erase_responses_batch(
        self, *, batch_size: int, tenant_id: str | None = None, user_id: str | None = None
    ) -> ErasedResponses:
        """Delete a batch of the trees holding a response that matches every criterion (a whole tree: its
        descendants' contexts hold the matching items), and the items the matching ones brought into conversations."""
        criteria = _criteria(responses, tenant_id, user_id)
        async with self.engine.begin() as conn:
            # Background turns too, whatever their status: one running stops when its claim is found gone.
            await conn.execute(delete(background_responses).where(*_criteria(background_responses, tenant_id, user_id)))
        chosen = select(responses.c.root_id).where(*criteria).distinct().limit(batch_size)
        return await self._delete_trees_erasing(chosen, criteria)

    async def purge_expired_conversations(self, *, now_ms: int, batch_size: int) -> list[str]:
        doomed = (
            select(conversations.c.id)
            .where(
                conversations.c.expires_ms <= now_ms,
                or_(conversations.c.lease_token.is_(None), conversations.c.lease_expires_ms <= now_ms),
            )
            .limit(batch_size)
        )
        return await self._delete_conversations(doomed)

    async def erase_conversations_batch(
        self, *, batch_size: int, tenant_id: str | None = None, user_id: str | None = None
    ) -> list[str]:
        criteria = _criteria(conversations, tenant_id, user_id)
        return await self._delete_conversations(select(conversations.c.id).where(*criteria).limit(batch_size))

    async def chained_responses(self, conversation_ids: list[str]) -> list[str]:
        """The responses chained (previous_response_id) from these conversations' responses: their cached contexts
        hold the conversations' items."""
        on_them = select(responses.c.id).where(responses.c.conversation_id.in_(conversation_ids))
        query = select(responses.c.id).where(responses.c.root_id.in_(on_them), responses.c.conversation_id.is_(None))
        async with self.engine.connect() as conn:
            return [row[0] for row in (await conn.execute(query)).all()]

    async def _delete_conversations(self, chosen: Any) -> list[str]:
        async with self.engine.begin() as conn:
            ids = [row[0] for row in (await conn.execute(chosen)).all()]
            if ids:
                await conn.execute(delete(conversations).where(conversations.c.id.in_(ids)))
        return ids


async def _erase_brought_items(conn: AsyncConnection, roots: list[str], criteria: list[Any]) -> list[str]:
    """Delete the conversation items brought by the responses of these trees that match `criteria`; returns the
    conversations touched. Each of those moves to a new version (its next position, as a deletion of an item does)
    and loses any lease, so a turn that read it before cannot commit on a context that had the items."""
    brought = (
        await conn.execute(
            select(
                responses.c.conversation_id,
                responses.c.conversation_position,
                func.coalesce(responses.c.input_count, 0) + func.coalesce(responses.c.output_count, 0),
            ).where(
                responses.c.root_id.in_(roots),
                responses.c.conversation_id.is_not(None),
                responses.c.conversation_position.is_not(None),
                *criteria,
            )
        )
    ).all()
    for conversation_id, first, count in brought:
        await conn.execute(
            delete(conversation_items).where(
                conversation_items.c.conversation_id == conversation_id,
                conversation_items.c.position >= first,
                conversation_items.c.position < first + count,
            )
        )
    touched = sorted({row[0] for row in brought})
    if touched:
        await conn.execute(
            update(conversations)
            .where(conversations.c.id.in_(touched))
            .values(next_position=conversations.c.next_position + 1, lease_token=None, lease_expires_ms=None)
        )
    return touched


def _criteria(table: Table, tenant_id: str | None, user_id: str | None) -> list[Any]:
    criteria = []
    if tenant_id is not None:
        criteria.append(table.c.tenant_id == tenant_id)
    if user_id is not None:
        criteria.append(table.c.metadata_user_id == user_id)
    if not criteria:
        raise ValueError("erasure needs at least one criterion")
    return criteria
