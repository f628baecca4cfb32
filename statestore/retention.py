"""Purge and erasure, shared by the admin API, the CLI and the background purger (PROTOCOL §5, §8).

The database goes first and the cache after: a cache entry left behind by a failure is unreachable (every read
starts from the thread row) and expires with its TTL.
"""

from __future__ import annotations

import asyncio
import logging

from sqlalchemy.exc import SQLAlchemyError

from statestore.clock import Clock
from statestore.store.admin_repository import AdminRepository
from statestore.store.cache import HistoryCache
from statestore.store.repository import ThreadQueries

log = logging.getLogger(__name__)


class Retention:
    def __init__(
        self, *, queries: ThreadQueries, admin: AdminRepository, cache: HistoryCache, clock: Clock, batch_size: int
    ) -> None:
        self.queries = queries
        self.admin = admin
        self.cache = cache
        self.clock = clock
        self.batch_size = batch_size

    async def purge(self, *, actor: str | None = None) -> int:
        """Delete every thread expired by now, batch by batch. With an actor (an admin's "purge now") the run is
        audited; the background purger's runs are only counted."""
        total = 0
        while True:
            ids = await self.queries.purge_expired(now_ms=self.clock(), batch_size=self.batch_size)
            if ids:
                await self.cache.delete_many(ids)
                await self.admin.add_to_counter("purged_threads", len(ids))
                total += len(ids)
            if len(ids) < self.batch_size:
                break
        if actor is not None:
            await self.admin.record(
                actor=actor, action="purge", target=None, after={"threads": total}, now_ms=self.clock()
            )
        if total:
            log.info("purged expired threads", extra={"threads": total})
        return total

    async def erase(self, *, actor: str, tenant_id: str | None = None, user_id: str | None = None) -> int:
        """Delete every thread of a tenant, of one `metadata.user_id`, or of both together, live or not."""
        total = 0
        while True:
            ids = await self.queries.erase_batch(batch_size=self.batch_size, tenant_id=tenant_id, user_id=user_id)
            if ids:
                await self.cache.delete_many(ids)
                await self.admin.add_to_counter("erased_threads", len(ids))
                total += len(ids)
            if len(ids) < self.batch_size:
                break
        target = ",".join(f"{k}={v}" for k, v in (("tenant", tenant_id), ("user_id", user_id)) if v is not None)
        await self.admin.record(
            actor=actor, action="erase", target=target, after={"threads": total}, now_ms=self.clock()
        )
        log.info("erased threads", extra={"threads": total, "actor": actor})
        return total

    async def delete_thread(self, owner: str, thread_id: str) -> bool:
        deleted = await self.queries.delete_thread(owner, thread_id, now_ms=self.clock())
        await self.cache.delete(thread_id)
        return deleted


async def run_purger(retention: Retention, interval_seconds: float) -> None:
    """The server's background purge loop: an expired thread's rows and cache keys are gone within one interval
    (plus the time a backlog takes) of its expiry. Failures are logged and retried on the next tick."""
    while True:
        await asyncio.sleep(interval_seconds)
        try:
            await retention.purge()
        except (SQLAlchemyError, OSError) as exc:
            log.warning("purge failed; retrying next interval", extra={"error": type(exc).__name__})
