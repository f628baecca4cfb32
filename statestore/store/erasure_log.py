"""The erasures an admin started (table `erasures`): each `running` until it is done or failed, readable from any
replica while it runs elsewhere. A running erasure is claimed by the process running it, which renews the claim (and
records what it erased so far) while it runs; one whose claim ran out is claimed by another replica, compare-and-set
on the claim, and run again from where it stopped (statestore/erasure_runs.py). A failed erasure with a retry due
(`retry_at_ms`) is claimed the same way, as a new attempt."""

from __future__ import annotations

from typing import Any, Literal

from sqlalchemy import Select, and_, insert, literal_column, or_, select, update
from sqlalchemy.engine import RowMapping
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.sql.elements import ColumnElement

from statestore.records import record
from statestore.store.retention_queries import Erasure
from statestore.store.schema import erasures

ErasureStatus = Literal["running", "done", "failed"]

# The sweep's statuses as literals, not bound parameters: so that PostgreSQL (under a generic plan too) and SQLite see
# that the sweep's query implies the partial index's predicate, `status IN ('running', 'failed')` (revision 0021).
_SWEPT = erasures.c.status.in_([literal_column("'running'"), literal_column("'failed'")])
_RUNNING = erasures.c.status == literal_column("'running'")
_FAILED = erasures.c.status == literal_column("'failed'")


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
    attempts: int = 1  # runs begun, the first included; a run taken up after its process stopped is the same attempt
    retry_at_ms: int | None = None  # failed, and to be run again from then on


class ErasureLog:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def begin(self, state: ErasureState, *, token: str, until_ms: int) -> None:
        """Record a new erasure, `running` and claimed by `token` until `until_ms`."""
        async with self.engine.begin() as conn:
            await conn.execute(
                insert(erasures).values(
                    id=state.id,
                    actor=state.actor,
                    tenant_id=state.tenant_id,
                    user_id=state.user_id,
                    status=state.status,
                    created_ms=state.created_ms,
                    attempts=state.attempts,
                    claim_token=token,
                    claim_expires_ms=until_ms,
                )
            )

    async def renew(self, erasure_id: str, *, token: str, until_ms: int, so_far: Erasure) -> bool:
        """Extend the claim `token` holds and record what the erasure erased so far; False when the claim was lost
        (taken over after it ran out) or the erasure ended."""
        statement = (
            update(erasures)
            .where(erasures.c.id == erasure_id, erasures.c.claim_token == token, erasures.c.status == "running")
            .values(
                claim_expires_ms=until_ms,
                threads=so_far.threads,
                responses=so_far.responses,
                conversations=so_far.conversations,
            )
        )
        async with self.engine.begin() as conn:
            return (await conn.execute(statement)).rowcount == 1

    async def release(self, erasure_id: str, *, token: str, now_ms: int) -> None:
        """Hand a running erasure back (its process is stopping): any replica may take it up now."""
        statement = (
            update(erasures)
            .where(erasures.c.id == erasure_id, erasures.c.claim_token == token, erasures.c.status == "running")
            .values(claim_expires_ms=now_ms)
        )
        async with self.engine.begin() as conn:
            await conn.execute(statement)

    @staticmethod
    def _unclaimed(now_ms: int, unclaimed_since_ms: int) -> ColumnElement[bool]:
        # No claim at all: begun by a replica older than claims; taken up once it is older than a lease.
        return and_(
            _RUNNING,
            or_(
                erasures.c.claim_expires_ms <= now_ms,
                and_(erasures.c.claim_expires_ms.is_(None), erasures.c.created_ms <= unclaimed_since_ms),
            ),
        )

    @staticmethod
    def _due(now_ms: int) -> ColumnElement[bool]:
        return and_(_FAILED, erasures.c.retry_at_ms <= now_ms)

    @classmethod
    def sweep(cls, *, now_ms: int, unclaimed_since_ms: int, limit: int) -> Select[Any]:
        """claimable()'s query: read through the partial index of running and failed erasures, however many are done."""
        return (
            select(erasures.c.id, erasures.c.status)
            .where(_SWEPT, or_(cls._unclaimed(now_ms, unclaimed_since_ms), cls._due(now_ms)))
            .order_by(erasures.c.created_ms)
            .limit(limit)
        )

    async def claimable(self, *, now_ms: int, unclaimed_since_ms: int, limit: int) -> list[tuple[str, ErasureStatus]]:
        """Running erasures whose claim ran out (their process stopped renewing it) and failed ones whose retry is
        due, oldest first, each with its status."""
        query = self.sweep(now_ms=now_ms, unclaimed_since_ms=unclaimed_since_ms, limit=limit)
        async with self.engine.connect() as conn:
            return [(row[0], row[1]) for row in (await conn.execute(query)).all()]

    async def claim(
        self,
        erasure_id: str,
        *,
        token: str,
        now_ms: int,
        until_ms: int,
        unclaimed_since_ms: int,
        retry: bool = False,
    ) -> tuple[ErasureState, Erasure] | None:
        """Take up a running erasure whose claim ran out or, `retry`, a failed one whose retry is due (`running`
        again, its next attempt): the erasure, and what the runs before erased (their last record of it); None when
        another replica claimed it first, or it ended."""
        if retry:
            taking = (
                update(erasures)
                .where(erasures.c.id == erasure_id, self._due(now_ms))
                .values(
                    status="running",
                    attempts=erasures.c.attempts + 1,
                    retry_at_ms=None,
                    finished_ms=None,
                    claim_token=token,
                    claim_expires_ms=until_ms,
                )
            )
        else:
            taking = (
                update(erasures)
                .where(erasures.c.id == erasure_id, self._unclaimed(now_ms, unclaimed_since_ms))
                .values(claim_token=token, claim_expires_ms=until_ms)
            )
        async with self.engine.begin() as conn:
            taken = await conn.execute(taking)
            if taken.rowcount != 1:
                return None
            row = (await conn.execute(select(erasures).where(erasures.c.id == erasure_id))).mappings().one()
        so_far = Erasure(
            threads=row["threads"] or 0, responses=row["responses"] or 0, conversations=row["conversations"] or 0
        )
        return _state(row), so_far

    async def finish(self, erasure_id: str, erased: Erasure, *, now_ms: int) -> bool:
        """Mark the erasure done with what it erased; False when it had ended already (another run finished it)."""
        async with self.engine.begin() as conn:
            done = await conn.execute(
                update(erasures)
                .where(erasures.c.id == erasure_id, erasures.c.status == "running")
                .values(
                    status="done",
                    finished_ms=now_ms,
                    threads=erased.threads,
                    responses=erased.responses,
                    conversations=erased.conversations,
                    claim_token=None,
                    claim_expires_ms=None,
                )
            )
            return done.rowcount == 1

    async def fail(self, erasure_id: str, *, token: str, now_ms: int, so_far: Erasure, retry_at_ms: int | None) -> None:
        """Mark the erasure failed, with what it erased so far and when it is retried (None: never), unless another
        run holds it now (or it ended): that run decides how it ends."""
        async with self.engine.begin() as conn:
            await conn.execute(
                update(erasures)
                .where(erasures.c.id == erasure_id, erasures.c.status == "running", erasures.c.claim_token == token)
                .values(
                    status="failed",
                    finished_ms=now_ms,
                    retry_at_ms=retry_at_ms,
                    threads=so_far.threads,
                    responses=so_far.responses,
                    conversations=so_far.conversations,
                    claim_token=None,
                    claim_expires_ms=None,
                )
            )

    async def get(self, erasure_id: str) -> ErasureState | None:
        async with self.engine.connect() as conn:
            row = (await conn.execute(select(erasures).where(erasures.c.id == erasure_id))).mappings().first()
        return _state(row) if row is not None else None


def _state(row: RowMapping) -> ErasureState:
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
        attempts=row["attempts"],
        retry_at_ms=row["retry_at_ms"],
    )
