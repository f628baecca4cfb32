"""What a process that reads or writes stored state opens first and closes last: the database engine, the key store
and the content keys sealed and opened through it, the one Redis client and the cache on it, and the clock. The server
builds every service on these (statestore/resources.py); `statestore admin` only the admin's
(statestore/admin_setup.py)."""

from __future__ import annotations

from contextlib import AsyncExitStack
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

from statestore.clock import Clock, clock_from
from statestore.config import Settings
from statestore.content_keys import ContentKeys
from statestore.encryption.setup import content_keys
from statestore.store.cache import HistoryCache
from statestore.store.cache_setup import create_cache
from statestore.store.engine import create_engine
from statestore.store.resp import RedisClient
from statestore.store.resp_cluster import redis_client


@dataclass(frozen=True, slots=True)
class Storage:
    # The cold paths' engine: single statements and transactions alike.
    engine: AsyncEngine
    # Where the wrapped data keys live (the content database's engine unless STATESTORE_KEYSTORE_URL is set), and the
    # keys every content byte is sealed and opened through (encryption off: a pass-through).
    keystore_engine: AsyncEngine
    content: ContentKeys
    # The process's one Redis client (None without STATESTORE_REDIS_URL): one pool, one breaker (a Cluster's: per
    # node), shared by the cache, claims, heads and the background events, each call bound by its own kind's timeout.
    redis: RedisClient | None
    cache: HistoryCache
    clock: Clock


def open_storage(settings: Settings, stack: AsyncExitStack, *, pool_size: int | None = None) -> Storage:
    """Open each piece, its closing pushed on `stack` (the cache closed before the Redis client it uses). `pool_size`
    (the admin CLI's small pools) overrides the connection budget's."""
    postgres = settings.database_url.startswith("postgresql")
    # The connection budget (docs/deployment.md): on PostgreSQL the hot statements' pool holds N connections
    # (store/pg_hot_path.py), this engine the cold paths' N // 2, single statements and transactions alike, less the
    # one of a key store of its own.
    own_keystore = 1 if settings.keystore_url else 0
    cold_size = pool_size or (max(1, settings.database_pool_size // 2 - own_keystore) if postgres else None)
    engine = create_engine(settings, pool_size=cold_size)
    stack.push_async_callback(engine.dispose)
    clock = clock_from(settings.clock_offset_file)
    keystore_engine = engine
    if settings.keystore_url:
        # Keys are read once and cached (store/keystore.py): one connection serves them.
        keystore_engine = create_engine(settings.keystore_url, pool_size=own_keystore)
        stack.push_async_callback(keystore_engine.dispose)
    content = content_keys(settings, keystore_engine, clock)
    redis = redis_client(settings.redis_url) if settings.redis_url else None
    if redis is not None:
        stack.push_async_callback(redis.aclose)  # after all that use it
    cache = create_cache(redis, settings.redis_prefix, content)
    stack.push_async_callback(cache.aclose)
    return Storage(
        engine=engine, keystore_engine=keystore_engine, content=content, redis=redis, cache=cache, clock=clock
    )
