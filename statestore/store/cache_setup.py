"""The history cache a deployment runs: Redis when configured, otherwise the in-process cache of the embedded
default, either one sealed when encryption at rest is on (store/sealed_cache.py)."""

from __future__ import annotations

from statestore.content_keys import ContentKeys
from statestore.store.cache import HistoryCache, RedisHistoryCache
from statestore.store.memory_cache import MemoryHistoryCache
from statestore.store.sealed_cache import SealedCache


def create_cache(redis_url: str | None, prefix: str, content: ContentKeys | None = None) -> HistoryCache:
    """Redis when configured, otherwise the in-process cache; sealed when `content` is enabled (encryption on)."""
    backend: RedisHistoryCache | MemoryHistoryCache
    backend = RedisHistoryCache(redis_url, prefix) if redis_url else MemoryHistoryCache()
    if content is not None and content.enabled:
        return SealedCache(backend, content)
    return backend
