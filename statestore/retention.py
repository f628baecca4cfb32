"""Purge and erasure, shared by the admin API, the CLI and the background purger (docs/protocol.md §5, §8).

The database goes first and the cache after: a cache entry left behind by a failure is unreachable (every read
starts from the thread row) and expires with its TTL. An erasure destroys the scopes' data keys before either
(docs/encryption.md): from that instant the content opens nowhere, so an erasure cut off midway, or a backup taken
before it, leaves nothing readable.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from statestore.clock import Clock
from statestore.content_keys import ContentKeys
from statestore.store.admin_repository import AdminRepository, Shortened
from statestore.store.cache import HistoryCache
from statestore.store.cache_entry import CacheKey, conversation_key, response_key, thread_key
from statestore.store.engine import DATABASE_ERRORS
from statestore.store.idempotency_store import IdempotencyStore
from statestore.store.retention_queries import Erasure, RetentionQueries

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ErasureProgress:
    """What an erasure has erased so far, batch by batch: its process records it with its claim, so that a replica
    taking the erasure up after that process stopped reports what the two runs erased together."""

    threads: int = 0
    responses: int = 0
    conversations: int = 0


@dataclass(frozen=True, slots=True)
class Purged:
    """What one purge deleted, by kind: the Messages door's threads, the Responses door's responses and
    conversations."""

    threads: int
    responses: int
    conversations: int


class Retention:
    def __init__(
        self,
        *,
        queries: RetentionQueries,
        admin: AdminRepository,
        cache: HistoryCache,
        clock: Clock,
        batch_size: int,
        content: ContentKeys | None = None,
        idempotency: IdempotencyStore | None = None,
    ) -> None:
        self.queries = queries
        # Kept outcomes of Idempotency-Keys: purged when their time is up, erased with their owner's data.
        self.idempotency = idempotency
        # None only where no erasure runs (a purge-only tool): erase() refuses to run without it.
        self.content = content
        self.admin = admin
        self.cache = cache
        self.clock = clock
        self.batch_size = batch_size
        # Threads whose rows are gone but whose cache entries could not be deleted (Redis unreachable); retried on
        # every purge until they are. Unservable meanwhile: every read starts from the rows.
        self.cache_debt: set[CacheKey] = set()

    async def forget_in_cache(self, keys: list[CacheKey]) -> None:
        """Drop cache entries whose rows are gone (a deleted response's tree, say), retried later when unreachable."""
        await self._forget_in_cache(keys)

    async def _forget_in_cache(self, keys: list[CacheKey]) -> None:
        if not await self.cache.delete_many(keys):
            self.cache_debt.update(keys)
            log.warning("cache entries of deleted conversations left for retry", extra={"entries": len(keys)})

    async def forget_shortened(self, shortened: Shortened) -> None:
        """Drop the cached rows of threads and responses a policy shortened: kept as they were, with the old expiry,
        they would serve a thread's continue (a Redis claim) or a chain's (its head) past the new maximum."""
        keys = [thread_key(i) for i in shortened.threads] + [response_key(i) for i in shortened.responses]
        if keys:
            await self._forget_in_cache(keys)

    async def forget_conversations(self, conversation_ids: list[str]) -> None:
        """Drop the cached contexts made of these conversations' items: each conversation's own, and those of the
        responses chained from its responses (whose rebuilds read the conversation's items where they are)."""
        chained = await self.queries.chained_responses(conversation_ids) if conversation_ids else []
        await self._forget_in_cache(
            [conversation_key(i) for i in conversation_ids] + [response_key(i) for i in chained]
        )

    async def settle_cache_debt(self) -> None:
        if self.cache_debt:
            owed = sorted(self.cache_debt)
            if await self.cache.delete_many(owed):
                self.cache_debt.difference_update(owed)

    async def purge(self, *, actor: str | None = None) -> Purged:
        """Delete every thread, response tree and conversation expired by now, batch by batch. Every run, the
        background purger's or an admin's ("purge now"), is the purger's last run; an admin's is audited too."""
        await self.settle_cache_debt()
        total = 0
        while True:
            ids = await self.queries.purge_expired(now_ms=self.clock(), batch_size=self.batch_size)
            if ids:
                await self._forget_in_cache([thread_key(i) for i in ids])
                await self.admin.add_to_counter("purged_threads", len(ids))
                total += len(ids)
            if len(ids) < self.batch_size:
                break
        responses, conversations = await self._purge_responses()
        await self._purge_idempotency_keys()
        await self.admin.set_counter("purger_last_run_ms", self.clock())
        if actor is not None:
            after = {"threads": total, "responses": responses, "conversations": conversations}
            await self.admin.record(actor=actor, action="purge", target=None, after=after, now_ms=self.clock())
        if total or responses or conversations:
            log.info("purged expired", extra={"threads": total, "responses": responses, "conversations": conversations})
        return Purged(threads=total, responses=responses, conversations=conversations)

    async def erase(
        self,
        *,
        actor: str,
        tenant_id: str | None = None,
        user_id: str | None = None,
        progress: ErasureProgress | None = None,
        resumed: bool = False,
    ) -> Erasure:
        """Delete every thread, response tree and conversation of a tenant, of one `metadata.user_id`, or of both
        together, live or not. Their data keys are destroyed first (with encryption off too: keys made while it was
        on still name their scopes), so the rows are unreadable before the first is deleted. Idempotent: run again
        (`resumed`, after its process stopped midway), it erases what is left. `progress` follows it batch by
        batch."""
        if self.content is None:
            raise RuntimeError("an erasure needs the content keys (Retention(content=...))")
        progress = progress if progress is not None else ErasureProgress()
        keys = await self.content.erase(tenant_id=tenant_id, user_id=user_id, resumed=resumed)
        total = 0
        while True:
            ids = await self.queries.erase_batch(batch_size=self.batch_size, tenant_id=tenant_id, user_id=user_id)
            if ids:
                await self._forget_in_cache([thread_key(i) for i in ids])
                await self.admin.add_to_counter("erased_threads", len(ids))
                total += len(ids)
                progress.threads = total
            if len(ids) < self.batch_size:
                break
        responses, conversations = await self._erase_responses(tenant_id, user_id, progress)
        if self.idempotency is not None:
            # The outcomes kept under their keys hold replies: they go with the rest (and opened nowhere already,
            # their data keys destroyed above).
            await self.idempotency.erase(tenant_id=tenant_id, user_id=user_id)
        target = ",".join(f"{k}={v}" for k, v in (("tenant", tenant_id), ("user_id", user_id)) if v is not None)
        # The audit target column holds 200 characters; a long user_id is shortened there, whole in `after`.
        target = target if len(target) <= 200 else target[:199] + "…"
        await self.admin.record(
            actor=actor,
            action="erase",
            target=target,
            after={
                "threads": total,
                "responses": responses,
                "conversations": conversations,
                "data_keys": keys,
                "tenant_id": tenant_id,
                "user_id": user_id,
            },
            now_ms=self.clock(),
        )
        log.info(
            "erased",
            extra={
                "threads": total,
                "responses": responses,
                "conversations": conversations,
                "data_keys": keys,
                "actor": actor,
            },
        )
        return Erasure(threads=total, responses=responses, conversations=conversations)

    async def _purge_idempotency_keys(self) -> None:
        if self.idempotency is None:
            return
        now, size = self.clock(), self.batch_size
        while await self.idempotency.purge_expired(now_ms=now, batch_size=size) == size:
            pass

    async def _drain(
        self,
        batch: Callable[[], Awaitable[list[str]]],
        counter: str,
        forget: Callable[[list[str]], Awaitable[None]],
        tally: Callable[[int], None] | None = None,
    ) -> int:
        total = 0
        while True:
            ids = await batch()
            if ids:
                await forget(ids)
                await self.admin.add_to_counter(counter, len(ids))
                total += len(ids)
                if tally is not None:
                    tally(total)
            if len(ids) < self.batch_size:
                return total

    async def _forget_responses(self, response_ids: list[str]) -> None:
        await self._forget_in_cache([response_key(i) for i in response_ids])

    async def _purge_responses(self) -> tuple[int, int]:
        """Expired response trees and conversations (the Responses front door), batch by batch."""
        now, size = self.clock(), self.batch_size
        responses = await self._drain(
            lambda: self.queries.purge_expired_responses(now_ms=now, batch_size=size),
            "purged_responses",
            self._forget_responses,
        )
        conversations = await self._drain(
            lambda: self.queries.purge_expired_conversations(now_ms=now, batch_size=size),
            "purged_conversations",
            self.forget_conversations,
        )
        return responses, conversations

    async def _erase_responses(
        self, tenant_id: str | None, user_id: str | None, progress: ErasureProgress
    ) -> tuple[int, int]:
        size = self.batch_size

        async def erase_batch() -> list[str]:
            erased = await self.queries.erase_responses_batch(batch_size=size, tenant_id=tenant_id, user_id=user_id)
            if erased.conversation_ids:
                # Their items changed: their cached contexts (and those of chains begun on them) go with the batch.
                await self.forget_conversations(erased.conversation_ids)
            return erased.response_ids

        def responses_so_far(count: int) -> None:
            progress.responses = count

        def conversations_so_far(count: int) -> None:
            progress.conversations = count

        responses = await self._drain(erase_batch, "erased_responses", self._forget_responses, responses_so_far)
        conversations = await self._drain(
            lambda: self.queries.erase_conversations_batch(batch_size=size, tenant_id=tenant_id, user_id=user_id),
            "erased_conversations",
            self.forget_conversations,
            conversations_so_far,
        )
        return responses, conversations

    async def delete_thread(self, owner: str, thread_id: str) -> bool:
        """Erase one of the owner's threads now; True when it was live. The cache entry goes only with the rows: a
        request naming another owner's thread must not touch it."""
        live, deleted = await self.queries.delete_thread(owner, thread_id, now_ms=self.clock())
        if deleted:
            await self._forget_in_cache([thread_key(thread_id)])
        return live


async def run_purger(retention: Retention, interval_seconds: float) -> None:
    """The server's background purge loop: an expired thread's rows and cache keys are gone within one interval
    (plus the time a backlog takes) of its expiry. Cache entries a deletion could not reach are retried every second
    in between. Failures are logged and retried on the next tick: a database outage as a warning, anything else as an
    error naming the exception's type and where it was raised, never its message (it may quote stored content). Only
    cancellation ends the loop."""
    tick = min(interval_seconds, 1.0)
    next_purge = time.monotonic() + interval_seconds
    while True:
        await asyncio.sleep(tick)
        try:
            if time.monotonic() >= next_purge:
                next_purge = time.monotonic() + interval_seconds
                await retention.purge()
            else:
                await retention.settle_cache_debt()
        except DATABASE_ERRORS as exc:
            log.warning("purge failed; retrying next interval", extra={"error": type(exc).__name__})
        except Exception as exc:
            log.error("purge failed unexpectedly; retrying next interval", extra=_failure(exc))


def _failure(exc: BaseException) -> dict[str, str]:
    """The type of a failure and the innermost frame it came from: enough to find the bug, no content."""
    where = ""
    trace = exc.__traceback__
    while trace is not None:
        where = f"{trace.tb_frame.f_code.co_filename}:{trace.tb_lineno}"
        trace = trace.tb_next
    return {"error": type(exc).__name__, "where": where}
