"""A thread's context in the history cache: read for a turn (a hit at the head's position, else rebuilt from the
database and put back), and written by the commit that made the new head (appended, or put whole when the base
moved, the thread is new, or a compaction replaced it)."""

from __future__ import annotations

import logging

from statestore.content_keys import ContentSealer
from statestore.errors import InternalError
from statestore.metrics import Metrics
from statestore.store.cache import HistoryCache
from statestore.store.cache_entry import CachedHistory, thread_key
from statestore.store.sealed_cache import CONSOLIDATE_FRAMES
from statestore.store.thread_claims import Settle
from statestore.store.thread_store import ThreadStore
from statestore.store.turn_records import LeasedThread
from statestore.threads import assembly
from statestore.threads.prepared import PreparedTurn

log = logging.getLogger(__name__)


async def context_of(
    cache: HistoryCache,
    repository: ThreadStore,
    metrics: Metrics,
    leased: LeasedThread,
    cached: CachedHistory | None,
    *,
    ttl_ms: int,
    sealer: ContentSealer,
) -> bytes:
    """The context (the head, then the stored messages from the base on), pre-joined: from the cache when it holds
    the thread's context at its head position, else rebuilt from the database (and the cache refilled). A cache
    entry is written only by the commit that made its head position, which knows the base it moved to."""
    if cached is not None and cached.count == leased.head_position:
        metrics.count_cache_lookup("hit")
        return cached.joined
    metrics.count_cache_lookup("miss" if cached is None else "stale")
    rows = await repository.load_context(leased.id, owner=leased.owner)
    stored = sum(1 for position, _ in rows if position >= 0)
    if stored != leased.head_position - leased.base_position:
        log.error(
            "thread rows disagree with its head position",
            extra={"thread_id": leased.id, "rows": stored, "head_position": leased.head_position},
        )
        raise InternalError("the stored thread is inconsistent")
    joined = assembly.join_history([body for _, body in rows])
    await cache.put(thread_key(leased.id), CachedHistory(leased.head_position, joined), ttl_ms, sealer=sealer)
    return joined


async def after_commit(
    cache: HistoryCache,
    prepared: PreparedTurn,
    added: list[bytes],
    compaction: bytes | None,
    then: Settle | None = None,
) -> None:
    """The committed turn's context into the cache under the new head's position. An append only when the entry
    still holds the context the turn was sent with: one the turn did not read is dropped instead. `then`: the row
    and claim a claiming cache settles in the same step (store/thread_claims.py)."""
    key = thread_key(prepared.thread_id)
    ttl_ms = prepared.ttl_seconds * 1000
    head_position = prepared.start_position + len(added)
    sealer = prepared.sealer
    if compaction is not None:
        await cache.put(key, CachedHistory(head_position, compaction), ttl_ms, sealer=sealer, then=then)
    elif prepared.creating or prepared.moved is not None:
        moved = [prepared.moved.joined] if prepared.moved is not None and prepared.moved.joined else []
        await cache.put(
            key, CachedHistory(head_position, assembly.join_history([*moved, *added])), ttl_ms, sealer=sealer, then=then
        )
    elif prepared.cache_frames > CONSOLIDATE_FRAMES:
        # A sealed entry of many frames (one per turn) is written back whole, as one frame, so the next read opens
        # one value, not one per turn. Unconditional, as a create's put is: its count says which head it holds.
        joined = assembly.join_history([prepared.history, *added]) if prepared.history else assembly.join_history(added)
        await cache.put(key, CachedHistory(head_position, joined), ttl_ms, sealer=sealer, then=then)
    else:
        await cache.append(key, prepared.history_count, added, ttl_ms, sealer=sealer, then=then)
