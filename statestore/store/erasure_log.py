"""The erasures an admin started (table `erasures`): each `running` until it is done or failed, readable from any
replica while it runs elsewhere."""

from __future__ import annotations

from typing import Literal

from sqlalchemy import insert, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from statestore.records import record
from statestore.store.retention_queries import Erasure
from statestore.store.schema import erasures

ErasureStatus = Literal["running", "done", "failed"]


@record
class ErasureState:
    id: str
    actor: str
    tenant_id: str | None
    user_id: str | None
    status: ErasureStatus
    created_ms: int
    finished_ms: int | None = None
    erased: Erasure | None = None  # once done


class ErasureLog:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def begin(self, state: ErasureState) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(
                insert(erasures).values(
                    id=state.id,
                    actor=state.actor,
                    tenant_id=state.tenant_id,
                    user_id=state.user_id,
                    status=state.status,
                    created_ms=state.created_ms,
                )
            )

    async def finish(self, erasure_id: str, erased: Erasure, *, now_ms: int) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(
                update(erasures)
                .where(erasures.c.id == erasure_id)
                .values(
                    status="done",
                    finished_ms=now_ms,
                    threads=erased.threads,
                    responses=erased.responses,
                    conversations=erased.conversations,
                )
            )

    async def fail(self, erasure_id: str, *, now_ms: int) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(
                update(erasures).where(erasures.c.id == erasure_id).values(status="failed", finished_ms=now_ms)
            )

    async def get(self, erasure_id: str) -> ErasureState | None:
        async with self.engine.connect() as conn:
            row = (await conn.execute(select(erasures).where(erasures.c.id == erasure_id))).mappings().first()
        if row is None:
            return None
        erased = None
        if row["status"] == "done":
            erased = Erasure(threads=row["threads"], responses=row["responses"], conversations=row["conversations"])
        return ErasureState(
            id=row["id"],
            actor=row["actor"],
            tenant_id=row["tenant_id"],
            user_id=row["user_id"],
            status=row["status"],
            created_ms=row["created_ms"],
            finished_ms=row["finished_ms"],
            erased=erased,
        )
