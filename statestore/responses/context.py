"""Where a turn's context comes from: the chain head's pre-joined bytes in the cache, else a join of the stored
bytes in the database; and the one place `truncation` is applied."""

from __future__ import annotations

from statestore.responses.errors import previous_response_not_found
from statestore.responses.store import ResponseRow, ResponseStore
from statestore.store.cache import CachedHistory, HistoryCache

CACHE_PREFIX = "resp:"


def cache_key(response_id: str) -> str:
    return CACHE_PREFIX + response_id


async def chain_context(store: ResponseStore, cache: HistoryCache, head: ResponseRow) -> bytes:
    """The joined messages of the chain ending at `head`. A cache entry is keyed by the response id and a stored
    response never changes, so any entry found is that response's context."""
    cached = await cache.get(cache_key(head.id))
    if cached is not None:
        return cached.joined
    joined = await store.chain_context(head)
    if joined is None:
        raise previous_response_not_found(head.id)
    return joined


async def remember_head(
    cache: HistoryCache, *, response_id: str, depth: int, joined: bytes, parent_id: str | None, ttl_ms: int
) -> None:
    """The new head's context goes in the cache; its parent's entry goes (a branch from it reads the database)."""
    await cache.put(cache_key(response_id), CachedHistory(depth + 1, joined), ttl_ms)
    if parent_id is not None:
        await cache.delete(cache_key(parent_id))


def truncated(context: bytes, truncation: str) -> bytes:
    """The context as sent for this request's `truncation`. "disabled" forwards it whole and the backend's context
    error is relayed. "auto" is accepted and, until the thread context policy (PROTOCOL §9) is wired here, is
    forwarded whole too."""
    del truncation
    return context
