"""The key store: wrapped data keys, one per erasure scope, in the content database or in one of their own
(STATESTORE_KEYSTORE_URL). Only this module reads or writes `data_keys`."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import delete, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncEngine

from statestore.store.engine import create_engine
from statestore.store.schema import data_keys


@dataclass(frozen=True, slots=True)
class StoredKey:
    id: str
    scope_hash: str
    owner: str
    tenant_id: str | None
    user_id: str | None
    master_id: str
    wrapped: bytes


@dataclass(frozen=True, slots=True)
class Rewrap:
    """A data key's new wrapping, to be stored if it is still wrapped under master key `was`."""

    id: str
    was: str
    master_id: str
    wrapped: bytes


_COLUMNS = (
    data_keys.c.id,
    data_keys.c.scope_hash,
    data_keys.c.owner,
    data_keys.c.tenant_id,
    data_keys.c.user_id,
    data_keys.c.master_id,
    data_keys.c.wrapped,
)


async def create_keystore(url: str) -> None:
    """The key store's table in a database of its own (`statestore migrate` with STATESTORE_KEYSTORE_URL)."""
    engine = create_engine(url, pool_size=1)
    try:
        await KeyStore(engine).create_table()
    finally:
        await engine.dispose()


class KeyStore:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._insert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert

    async def create_table(self) -> None:
        """For a key store in a database of its own (`statestore migrate` runs it): the content database gets the
        table from its migrations."""
        async with self.engine.begin() as conn:
            await conn.run_sync(lambda sync: data_keys.create(sync, checkfirst=True))

    async def by_scope(self, scope_hash: str) -> StoredKey | None:
        async with self.engine.connect() as conn:
            row = (await conn.execute(select(*_COLUMNS).where(data_keys.c.scope_hash == scope_hash))).first()
        return StoredKey(*row) if row else None

    async def add(self, key: StoredKey, now_ms: int) -> StoredKey:
        """Store `key` unless its scope has one already (another replica's, made at the same moment); the scope's
        key either way."""
        values = {c.name: getattr(key, c.name) for c in _COLUMNS} | {"created_ms": now_ms}
        stmt = self._insert(data_keys).values(**values).on_conflict_do_nothing(index_elements=[data_keys.c.scope_hash])
        async with self.engine.begin() as conn:
            await conn.execute(stmt)
            row = (await conn.execute(select(*_COLUMNS).where(data_keys.c.scope_hash == key.scope_hash))).one()
        return StoredKey(*row)

    async def by_ids(self, ids: Iterable[str]) -> dict[str, StoredKey]:
        wanted = list(ids)
        async with self.engine.connect() as conn:
            rows = (await conn.execute(select(*_COLUMNS).where(data_keys.c.id.in_(wanted)))).all()
        return {row[0]: StoredKey(*row) for row in rows}

    async def destroy(self, *, tenant_id: str | None, user_id: str | None) -> list[str]:
        """Delete the keys of every scope matching all the given criteria (an erasure's); their ids."""
        criteria = []
        if tenant_id is not None:
            criteria.append(data_keys.c.tenant_id == tenant_id)
        if user_id is not None:
            criteria.append(data_keys.c.user_id == user_id)
        if not criteria:
            raise ValueError("destroying keys needs at least one criterion")
        async with self.engine.begin() as conn:
            return list((await conn.execute(delete(data_keys).where(*criteria).returning(data_keys.c.id))).scalars())

    async def count_by_master(self) -> dict[str, int]:
        async with self.engine.connect() as conn:
            rows = await conn.execute(select(data_keys.c.master_id, func.count()).group_by(data_keys.c.master_id))
            return {master_id: int(count) for master_id, count in rows.all()}

    async def wrapped_under(self, master_ids: list[str], limit: int) -> list[StoredKey]:
        async with self.engine.connect() as conn:
            rows = await conn.execute(select(*_COLUMNS).where(data_keys.c.master_id.in_(master_ids)).limit(limit))
            return [StoredKey(*row) for row in rows.all()]

    async def rewrap(self, keys: list[Rewrap]) -> int:
        """Replace each key's wrapping if it is still wrapped under `was` (another rotation may have got there first,
        or an erasure deleted it), in one transaction; how many were replaced."""
        replaced = 0
        async with self.engine.begin() as conn:
            for key in keys:
                stmt = (
                    update(data_keys)
                    .where(data_keys.c.id == key.id, data_keys.c.master_id == key.was)
                    .values(master_id=key.master_id, wrapped=key.wrapped)
                )
                replaced += (await conn.execute(stmt)).rowcount
        return replaced
