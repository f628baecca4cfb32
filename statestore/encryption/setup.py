"""The content keys a process seals and opens through, built from its settings."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine

from statestore.clock import Clock
from statestore.config import Settings
from statestore.content_keys import ContentKeys
from statestore.encryption.content import ClearContent, SealedContent
from statestore.store.keystore import KeyStore


def content_keys(settings: Settings, keystore_engine: AsyncEngine, clock: Clock) -> ContentKeys:
    keystore = KeyStore(keystore_engine)
    ring = settings.master_keys()
    if ring is None:
        return ClearContent(keystore)
    return SealedContent(
        keystore,
        ring,
        clock=clock,
        remember_seconds=settings.data_key_cache_seconds,
        settle_seconds=settings.database_timeout_seconds + 1,
    )


async def encryption_problem(settings: Settings) -> str | None:
    """Why serving must not start with these keys and this key store (checked before the server starts): a master key
    missing or wrong, sealed content with no keys, a separate key store not made yet."""
    from statestore.store.engine import create_engine  # noqa: PLC0415

    engine = create_engine(settings.keystore_url or settings.database_url, pool_size=1)
    try:
        return await start_problem(settings, engine)
    finally:
        await engine.dispose()


async def start_problem(settings: Settings, keystore_engine: AsyncEngine) -> str | None:
    from sqlalchemy import inspect  # noqa: PLC0415

    async with keystore_engine.connect() as conn:
        exists = await conn.run_sync(lambda sync: inspect(sync).has_table("data_keys"))
    if not exists:
        if settings.keystore_url and settings.master_keys() is not None:
            return "the key store (STATESTORE_KEYSTORE_URL) has no data_keys table: run `statestore migrate` first"
        return None  # the content database's own migration check says what is missing
    return await content_keys(settings, keystore_engine, lambda: 0).start_problem()
