"""The history cache a deployment runs: Redis when configured, otherwise the in-process cache of the embedded
default, either one sealed when encryption at rest is on (store/sealed_cache.py)."""

from __future__ import annotations

from statestore.config import Settings
from statestore.content_keys import ContentKeys
from statestore.store.cache import HistoryCache
from statestore.store.memory_cache import MemoryHistoryCache
from statestore.store.pg_hot_path import PgHotPath
from statestore.store.redis_cache import RedisHistoryCache
from statestore.store.resp import RedisClient
from statestore.store.response_heads import ResponseHeads
from statestore.store.sealed_cache import SealedCache
from statestore.store.thread_claims import ThreadClaims


def create_cache(redis: RedisClient | None, prefix: str, content: ContentKeys | None = None) -> HistoryCache:
    """On the process's Redis client when there is one (statestore/resources.py), otherwise the in-process cache;
    sealed when `content` is enabled (encryption on)."""
    backend: RedisHistoryCache | MemoryHistoryCache
    backend = RedisHistoryCache(redis, prefix) if redis is not None else MemoryHistoryCache()
    if content is not None and content.enabled:
        return SealedCache(backend, content)
    return backend


def thread_claims(settings: Settings, cache: HistoryCache, pg: PgHotPath | None) -> ThreadClaims | None:
    """Claims on thread heads (store/thread_claims.py) where they save a round trip and PostgreSQL guards the commit:
    a Redis cache in clear, standalone or Cluster (a sealed one keeps no rows: they hold the system prompt and tools),
    PostgreSQL's prepared statements, and `STATESTORE_REDIS_CLAIMS` left on."""
    if not settings.redis_claims or pg is None or not isinstance(cache, RedisHistoryCache):
        return None
    return cache.thread_claims()


def response_heads(settings: Settings, cache: HistoryCache) -> ResponseHeads | None:
    """Chain heads' rows kept beside their cached contexts (store/response_heads.py): a Redis cache in clear
    (standalone or Cluster), and `STATESTORE_REDIS_CLAIMS` left on (the switch of every row Redis serves in the
    database's stead)."""
    if not settings.redis_claims or not isinstance(cache, RedisHistoryCache):
        return None
    return cache.response_heads()
