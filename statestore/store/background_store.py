"""The SQL of background responses (schema.background_responses): admit a turn under its owner's bound, claim it
under a lease (any replica, compare-and-set on the claim), renew the claims a replica holds, ask for a cancel, and end
a turn in one of its final statuses.

The statements each background turn runs (its admission, the keep before its commit, its end) and the runner's poll
are store/background_statements.py's, each written once as Core: compiled for asyncpg and run on the hot path's
pools on PostgreSQL, through Core on SQLite. The rarer ones (a claim, a renewal, a cancel, a read) are SQLAlchemy Core
on both databases. A claim is a conditional update of one row (its status open, its claim absent or run out), so of
two replicas exactly one gets it, on PostgreSQL and SQLite alike, without a lock held between statements."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, delete, exists, func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from statestore.content_keys import ContentKeys, ContentSealer, Scope
from statestore.store.background_statements import (
    ADMIT,
    ADMIT_PG,
    CLAIMABLE,
    CLAIMABLE_PG,
    END,
    END_PG,
    KEEP_FOR_COMMIT,
    KEEP_FOR_COMMIT_PG,
    OPEN,
    Admit,
    Claimable,
    End,
    KeepForCommit,
)
from statestore.store.pg_hot_path import PgHotPath, affected
from statestore.store.response_sealing import active, background_data
from statestore.store.schema import background_responses as bg
from statestore.store.schema import responses

FINAL = ("completed", "incomplete", "failed", "cancelled")
STATUSES = (*OPEN, *FINAL)


@dataclass(frozen=True, slots=True)
class BackgroundJob:
    id: str
    owner: str
    tenant_id: str | None
    metadata_user_id: str | None
    conversation_id: str | None
    status: str
    request: bytes
    headers: bytes | None
    body: bytes
    attempt: int
    conversation_lease: str | None
    cancel_requested: bool
    created_ms: int
    expires_ms: int

    @property
    def open(self) -> bool:
        return self.status in OPEN

    @property
    def scope(self) -> Scope:
        """Its erasure scope: what its stored content and its events are sealed under."""
        return Scope(self.owner, self.tenant_id, self.metadata_user_id)


_COLUMNS = (
    bg.c.id,
    bg.c.owner,
    bg.c.tenant_id,
    bg.c.metadata_user_id,
    bg.c.conversation_id,
    bg.c.status,
    bg.c.request,
    bg.c.headers,
    bg.c.body,
    bg.c.attempt,
    bg.c.conversation_lease,
    bg.c.cancel_requested,
    bg.c.created_ms,
    bg.c.expires_ms,
)


def _job(row: Any) -> BackgroundJob:
    return BackgroundJob(**dict(zip(_FIELDS, row, strict=True)))


@dataclass(frozen=True, slots=True, kw_only=True)
class NewJob:
    id: str
    owner: str
    tenant_id: str | None
    metadata_user_id: str | None
    conversation_id: str | None
    conversation_lease: str | None
    request: bytes
    headers: bytes
    body: bytes
    now_ms: int
    expires_ms: int


class BackgroundStore:
    def __init__(
        self,
        engine: AsyncEngine,
        single_statements: AsyncEngine | None = None,
        pg: PgHotPath | None = None,
        content: ContentKeys | None = None,
    ) -> None:
        """`single_statements`: an engine in AUTOCOMMIT for the statements that are atomic by themselves (all but the
        claim), so they run without a BEGIN and a COMMIT around them. `pg`: on PostgreSQL, the admission and the end
        run as prepared statements there."""
        self.engine = engine
        self._single = single_statements or engine.execution_options(isolation_level="AUTOCOMMIT")
        self._pg = pg
        # With encryption on, the request, its headers (the client's credential) and the Response are sealed under
        # the turn's scope, each bound to its row and column (store/response_sealing.py).
        self._keys = active(content)

    async def _opened(self, row: Any) -> BackgroundJob:
        job = _job(row)
        if self._keys is None:
            return job
        values = [job.request, job.body] if job.headers is None else [job.request, job.body, job.headers]
        columns = ("request", "body", "headers")
        data = [background_data(job.owner, job.id, column) for column in columns[: len(values)]]
        opened = await self._keys.open_many(values, data, row=f"background_responses:{job.id}")
        headers = opened[2] if len(opened) > 2 else None
        return dataclasses.replace(job, request=opened[0], body=opened[1], headers=headers)

    async def _sealer(self, scope: Scope | None) -> ContentSealer | None:
        if self._keys is None:
            return None
        if scope is None:
            raise ValueError("a background turn's body to seal names its scope")
        return await self._keys.sealer(scope)

    async def admit(
        self, job: NewJob, *, bound: int, claim_token: str | None, claim_until_ms: int, started: bool
    ) -> BackgroundJob | None:
        """Insert the turn unless its owner already has `bound` open ones (None), in one statement; the turn as
        inserted. With `claim_token` the turn is claimed by the caller at once (attempt 1), and `started` says it runs
        now (else it waits queued for a worker of the caller's); without, it waits queued for any replica."""
        claimed = claim_token is not None
        status = "in_progress" if claimed and started else "queued"
        attempt = 1 if claimed else 0
        request, headers, body = job.request, job.headers, job.body
        sealer = await self._sealer(Scope(job.owner, job.tenant_id, job.metadata_user_id))
        if sealer is not None:
            request = sealer.seal(request, background_data(job.owner, job.id, "request"))
            headers = sealer.seal(headers, background_data(job.owner, job.id, "headers"))
            body = sealer.seal(body, background_data(job.owner, job.id, "body"))
        admit = Admit(
            id=job.id,
            owner=job.owner,
            tenant_id=job.tenant_id,
            metadata_user_id=job.metadata_user_id,
            conversation_id=job.conversation_id,
            conversation_lease=job.conversation_lease,
            status=status,
            request=request,
            headers=headers,
            body=body,
            claim_token=claim_token,
            claim_expires_ms=claim_until_ms if claimed else None,
            attempt=attempt,
            now_ms=job.now_ms,
            expires_ms=job.expires_ms,
            bound=bound,
        )
        if self._pg is not None:
            if affected(await self._pg.execute(ADMIT_PG, admit)) != 1:
                return None
        else:
            async with self._single.connect() as conn:
                if (await conn.execute(ADMIT.statement, ADMIT.values(admit))).rowcount != 1:
                    return None
        return BackgroundJob(
            id=job.id,
            owner=job.owner,
            tenant_id=job.tenant_id,
            metadata_user_id=job.metadata_user_id,
            conversation_id=job.conversation_id,
            status=status,
            request=job.request,
            headers=job.headers,
            body=job.body,
            attempt=attempt,
            conversation_lease=job.conversation_lease,
            cancel_requested=False,
            created_ms=job.now_ms,
            expires_ms=job.expires_ms,
        )

    async def get(self, owner: str, response_id: str, *, now_ms: int) -> BackgroundJob | None:
        query = select(*_COLUMNS).where(bg.c.id == response_id, bg.c.owner == owner, bg.c.expires_ms > now_ms)
        async with self._single.connect() as conn:
            row = (await conn.execute(query)).first()
        return await self._opened(row) if row is not None else None

    async def claimable(self, *, now_ms: int, limit: int) -> list[str]:
        """Open turns no live claim holds, oldest first: queued ones, and those whose replica stopped renewing."""
        claimable = Claimable(now_ms=now_ms, limit=limit)
        if self._pg is not None:
            return [row[0] for row in await self._pg.fetch(CLAIMABLE_PG, claimable)]
        async with self._single.connect() as conn:
            return [row[0] for row in (await conn.execute(CLAIMABLE.statement, CLAIMABLE.values(claimable))).all()]

    async def claim(self, response_id: str, *, token: str, now_ms: int, until_ms: int) -> BackgroundJob | None:
        """Take an open turn that no live claim holds; None when another replica took it first. The row as it was
        before the claim (its status says whether an earlier run had begun), with the new attempt number."""
        async with self.engine.begin() as conn:
            before = (await conn.execute(select(bg.c.status).where(bg.c.id == response_id))).first()
            if before is None:
                return None
            taken = (
                await conn.execute(
                    update(bg)
                    .where(
                        bg.c.id == response_id,
                        bg.c.status.in_(OPEN),
                        or_(bg.c.claim_expires_ms.is_(None), bg.c.claim_expires_ms <= now_ms),
                    )
                    .values(
                        claim_token=token,
                        claim_expires_ms=until_ms,
                        attempt=bg.c.attempt + 1,
                        status="in_progress",
                        updated_ms=now_ms,
                    )
                    .returning(*_COLUMNS)
                )
            ).first()
        if taken is None:
            return None
        job = await self._opened(taken)
        # The status it had: "queued" never ran; "in_progress" ran on a replica that stopped renewing its claim.
        return dataclasses.replace(job, status=before[0])

    async def start(self, response_id: str, *, token: str, now_ms: int) -> bool:
        """A queued turn this replica holds begins to run; False when it was cancelled or taken over meanwhile."""
        statement = (
            update(bg)
            .where(
                bg.c.id == response_id,
                bg.c.claim_token == token,
                bg.c.status == "queued",
                bg.c.cancel_requested.is_(False),
            )
            .values(status="in_progress", updated_ms=now_ms)
        )
        async with self._single.connect() as conn:
            return (await conn.execute(statement)).rowcount == 1

    async def release(self, response_id: str, *, token: str, now_ms: int) -> None:
        """Hand a turn back (this replica is stopping): its claim runs out now, so any replica may claim it."""
        statement = (
            update(bg)
            .where(bg.c.id == response_id, bg.c.claim_token == token, bg.c.status.in_(OPEN))
            .values(claim_expires_ms=now_ms, updated_ms=now_ms)
        )
        async with self._single.connect() as conn:
            await conn.execute(statement)

    async def keep_for_commit(self, response_id: str, *, token: str, now_ms: int, until_ms: int) -> bool:
        """The run may commit: the turn is still this replica's and nobody asked to cancel it; its claim renewed.
        False: it was cancelled, or another replica took it over (the run must not commit)."""
        keep = KeepForCommit(id=response_id, token=token, now_ms=now_ms, until_ms=until_ms)
        if self._pg is not None:
            return affected(await self._pg.execute(KEEP_FOR_COMMIT_PG, keep)) == 1
        async with self._single.connect() as conn:
            return (await conn.execute(KEEP_FOR_COMMIT.statement, KEEP_FOR_COMMIT.values(keep))).rowcount == 1

    async def renew(self, token: str, ids: Sequence[str], *, now_ms: int, until_ms: int) -> set[str]:
        """Extend the claims this replica holds; the ids it still holds (a turn missing was taken over or ended)."""
        if not ids:
            return set()
        statement = (
            update(bg)
            .where(bg.c.id.in_(list(ids)), bg.c.claim_token == token, bg.c.status.in_(OPEN))
            .values(claim_expires_ms=until_ms, updated_ms=now_ms)
            .returning(bg.c.id)
        )
        async with self._single.connect() as conn:
            return {row[0] for row in (await conn.execute(statement)).all()}

    async def cancels(self, ids: Sequence[str]) -> list[str]:
        """Of these running turns, those someone asked to cancel (from any replica)."""
        if not ids:
            return []
        query = select(bg.c.id).where(bg.c.id.in_(list(ids)), bg.c.cancel_requested.is_(True))
        async with self._single.connect() as conn:
            return [row[0] for row in (await conn.execute(query)).all()]

    async def request_cancel(self, owner: str, response_id: str, *, now_ms: int) -> str | None:
        """Mark an open turn to be cancelled; the status it had (None: no such open turn of the owner's)."""
        statement = (
            update(bg)
            .where(bg.c.id == response_id, bg.c.owner == owner, bg.c.status.in_(OPEN), bg.c.expires_ms > now_ms)
            .values(cancel_requested=True, updated_ms=now_ms)
            .returning(bg.c.status, bg.c.claim_expires_ms)
        )
        async with self._single.connect() as conn:
            row = (await conn.execute(statement)).first()
        if row is None:
            return None
        status, claim_expires = row
        # A turn whose claim ran out is as good as queued: nobody runs it, and whoever claims it next sees the flag.
        # (A queued one a replica holds, waiting for a worker there, stays "queued": that replica ends it.)
        return "queued" if claim_expires is None or claim_expires <= now_ms else str(status)

    async def end_unclaimed(
        self, response_id: str, *, status: str, body: bytes, now_ms: int, scope: Scope | None = None
    ) -> BackgroundJob | None:
        """End a turn no live claim holds (a queued one cancelled); None when a replica claimed it meanwhile, or its
        response was stored.
        `scope`: the turn's (BackgroundJob.scope), which its body is sealed under with encryption on."""
        sealer = await self._sealer(scope)
        if sealer is not None and scope is not None:
            body = sealer.seal(body, background_data(scope.owner, response_id, "body"))
        statement = (
            update(bg)
            .where(
                bg.c.id == response_id,
                bg.c.status.in_(OPEN),
                or_(bg.c.claim_expires_ms.is_(None), bg.c.claim_expires_ms <= now_ms),
                # A run whose claim ran out may still have stored its response: the turn then ends as stored.
                ~exists().where(responses.c.id == response_id),
            )
            .values(status=status, body=body, headers=None, claim_token=None, claim_expires_ms=None, updated_ms=now_ms)
            .returning(*_COLUMNS)
        )
        async with self._single.connect() as conn:
            row = (await conn.execute(statement)).first()
        return await self._opened(row) if row is not None else None

    async def end(
        self,
        response_id: str,
        *,
        token: str,
        status: str,
        body: bytes | None,
        now_ms: int,
        scope: Scope | None = None,
    ) -> bool:
        """End a turn this replica holds: its final status, its Response (None: kept, as for a stored one, whose
        responses row is the truth), its credential forgotten. False when the claim was lost. `scope`: the turn's
        (BackgroundJob.scope), which a body is sealed under with encryption on."""
        if body is not None:
            sealer = await self._sealer(scope)
            if sealer is not None and scope is not None:
                body = sealer.seal(body, background_data(scope.owner, response_id, "body"))
        ended = End(id=response_id, token=token, status=status, body=body, now_ms=now_ms)
        if self._pg is not None:
            return affected(await self._pg.execute(END_PG, ended)) == 1
        async with self._single.connect() as conn:
            return (await conn.execute(END.statement, END.values(ended))).rowcount == 1

    async def delete(self, owner: str, response_id: str) -> bool:
        async with self._single.connect() as conn:
            done = await conn.execute(delete(bg).where(bg.c.id == response_id, bg.c.owner == owner))
        return done.rowcount > 0


# The stats' name of each status (a turn in progress is "running" there).
STAT_NAMES = {status: f"background_{'running' if status == 'in_progress' else status}" for status in STATUSES}


async def background_counts(conn: AsyncConnection, *, now_ms: int, tenant_id: str | None) -> dict[str, int]:
    """Live background turns by status, under their stats names (the admin stats and the console)."""
    where = [bg.c.expires_ms > now_ms]
    if tenant_id is not None:
        where.append(bg.c.tenant_id == tenant_id)
    query = select(bg.c.status, func.count()).where(and_(*where)).group_by(bg.c.status)
    found = {str(status): int(count) for status, count in (await conn.execute(query)).all()}
    return {name: found.get(status, 0) for status, name in STAT_NAMES.items()}


_FIELDS = tuple(BackgroundJob.__dataclass_fields__)
