"""The SQL of idempotency keys (schema.idempotency_keys, docs/responses.md "Retries that never store twice"): claim a
key for a write (insert if absent), take over a claim that ran out, renew it, keep the write's outcome, free it, and
the deletions of retention (expired keys, an erasure's).

Only requests that carry a key come here, so these are SQLAlchemy Core statements on both databases. A claim is an
insert that does nothing on conflict, and a take-over a conditional update of one row (no outcome, the claim absent or
run out), so of two replicas exactly one holds a key at a time, on PostgreSQL and SQLite alike.

With encryption on, the outcome (it holds the reply's content) is sealed under the request's scope, bound to its owner
and key: ("ik", owner, key, "outcome")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
from sqlalchemy import delete, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncEngine

from statestore.content_keys import ContentKeys, Scope, row_data
from statestore.store.response_sealing import active
from statestore.store.schema import idempotency_keys as ik


@dataclass(frozen=True, slots=True)
class KeyedRequest:
    """A write sent with an Idempotency-Key: whose, the key, and a hash of what was asked (never the content)."""

    owner: str
    tenant_id: str | None
    user_id: str | None
    key: str
    fingerprint: str


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a write answered, to answer a retry the same: its status, its own headers, and its body (a JSON body, or
    a stream's events as sent). `follow`: a background response whose events a replayed stream follows instead."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    streamed: bool = False
    follow: str | None = None

    def encode(self) -> bytes:
        head = {
            "status": self.status,
            "headers": [[name.decode("latin-1"), value.decode("latin-1")] for name, value in self.headers],
            "streamed": self.streamed,
            "follow": self.follow,
        }
        return orjson.dumps(head) + b"\n" + self.body

    @classmethod
    def decode(cls, raw: bytes) -> Outcome:
        head, _, body = raw.partition(b"\n")  # orjson writes no newline inside a value
        fields = orjson.loads(head)
        return cls(
            status=fields["status"],
            headers=tuple((name.encode("latin-1"), value.encode("latin-1")) for name, value in fields["headers"]),
            body=body,
            streamed=fields["streamed"],
            follow=fields["follow"],
        )


@dataclass(frozen=True, slots=True)
class Held:
    """What a key holds when a request finds it taken."""

    fingerprint: str
    intended: str | None
    claimed: bool  # a write holds it now
    outcome: Outcome | None


def outcome_data(owner: str, key: str) -> bytes:
    return row_data("ik", owner, key, "outcome")


class IdempotencyStore:
    def __init__(self, engine: AsyncEngine, content: ContentKeys | None = None) -> None:
        self.engine = engine
        self._keys = active(content)
        self._insert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert

    async def claim(
        self, request: KeyedRequest, *, token: str, intended: str, now_ms: int, until_ms: int, expires_ms: int
    ) -> Held | None:
        """Claim the key for this request: None when claimed (a new row, or one whose time ran out taken anew), else
        what the key holds now."""
        values = {
            "owner": request.owner,
            "key": request.key,
            "tenant_id": request.tenant_id,
            "metadata_user_id": request.user_id,
            "fingerprint": request.fingerprint,
            "intended": intended,
            "claim_token": token,
            "claim_expires_ms": until_ms,
            "status": None,
            "outcome": None,
            "created_ms": now_ms,
            "expires_ms": expires_ms,
        }
        mine = (ik.c.owner == request.owner, ik.c.key == request.key)
        async with self.engine.begin() as conn:
            inserted = await conn.execute(self._insert(ik).values(values).on_conflict_do_nothing())
            if inserted.rowcount == 1:
                return None
            # A key kept past its time is as good as absent (the purger deletes it later).
            renewed = await conn.execute(update(ik).where(*mine, ik.c.expires_ms <= now_ms).values(values))
            if renewed.rowcount == 1:
                return None
            row = (
                await conn.execute(
                    select(
                        ik.c.fingerprint,
                        ik.c.intended,
                        ik.c.claim_token,
                        ik.c.claim_expires_ms,
                        ik.c.status,
                        ik.c.outcome,
                        ik.c.tenant_id,
                        ik.c.metadata_user_id,
                    ).where(*mine)
                )
            ).first()
        if row is None:  # deleted in between (purged, erased, freed): claim again
            return await self.claim(
                request, token=token, intended=intended, now_ms=now_ms, until_ms=until_ms, expires_ms=expires_ms
            )
        outcome = None
        if row.outcome is not None:
            raw = row.outcome
            if self._keys is not None:
                raw = await self._keys.open(raw, outcome_data(request.owner, request.key), row="idempotency_keys")
            outcome = Outcome.decode(raw)
        return Held(
            fingerprint=row.fingerprint,
            intended=row.intended,
            claimed=row.claim_token is not None and (row.claim_expires_ms or 0) > now_ms,
            outcome=outcome,
        )

    async def take_over(self, request: KeyedRequest, *, token: str, now_ms: int, until_ms: int) -> bool:
        """Claim a key whose write ended without an outcome (it failed, or its replica stopped): its intended ids are
        kept, for the new attempt to store under."""
        async with self.engine.begin() as conn:
            taken = await conn.execute(
                update(ik)
                .where(
                    ik.c.owner == request.owner,
                    ik.c.key == request.key,
                    ik.c.fingerprint == request.fingerprint,
                    ik.c.outcome.is_(None),
                    or_(ik.c.claim_token.is_(None), ik.c.claim_expires_ms <= now_ms),
                )
                .values(claim_token=token, claim_expires_ms=until_ms)
            )
        return bool(taken.rowcount == 1)

    async def renew(self, owner: str, key: str, token: str, *, until_ms: int) -> bool:
        async with self.engine.begin() as conn:
            renewed = await conn.execute(
                update(ik)
                .where(ik.c.owner == owner, ik.c.key == key, ik.c.claim_token == token)
                .values(claim_expires_ms=until_ms)
            )
        return bool(renewed.rowcount == 1)

    async def intend(self, owner: str, key: str, token: str, intended: str, *, user_id: str | None) -> bool:
        """Name the ids the claimed write will store and the user whose data it adds to, once it knows them (a threaded
        turn learns its thread only when it takes the head), still before its commit; False when the claim was lost."""
        async with self.engine.begin() as conn:
            named = await conn.execute(
                update(ik)
                .where(ik.c.owner == owner, ik.c.key == key, ik.c.claim_token == token)
                .values(intended=intended, metadata_user_id=user_id)
            )
        return bool(named.rowcount == 1)

    async def keep(self, request: KeyedRequest, outcome: Outcome, *, token: str | None) -> bool:
        """Keep the write's outcome under the key, ending its claim. `token` None: an outcome found stored (a write
        whose replica stopped before it kept it), kept unless another did first."""
        raw = outcome.encode()
        if self._keys is not None:
            scope = Scope(request.owner, request.tenant_id, request.user_id)
            raw = (await self._keys.sealer(scope)).seal(raw, outcome_data(request.owner, request.key))
        held: Any = ik.c.outcome.is_(None) if token is None else ik.c.claim_token == token
        async with self.engine.begin() as conn:
            kept = await conn.execute(
                update(ik)
                .where(ik.c.owner == request.owner, ik.c.key == request.key, held)
                .values(status=outcome.status, outcome=raw, claim_token=None, claim_expires_ms=None)
            )
        return bool(kept.rowcount == 1)

    async def free(self, owner: str, key: str, token: str, *, forget: bool) -> None:
        """End a claim whose write kept no outcome. `forget`: it stored nothing, so the key goes (a request with
        another body may use it); else the row stays with its intended ids, unclaimed, for a retry to look for."""
        mine = (ik.c.owner == owner, ik.c.key == key, ik.c.claim_token == token)
        async with self.engine.begin() as conn:
            if forget:
                await conn.execute(delete(ik).where(*mine))
            else:
                await conn.execute(update(ik).where(*mine).values(claim_token=None, claim_expires_ms=None))

    # -- retention

    async def purge_expired(self, *, now_ms: int, batch_size: int) -> int:
        """Delete a batch of keys kept past their time that no write holds; how many."""
        chosen = (
            select(ik.c.owner, ik.c.key)
            .where(ik.c.expires_ms <= now_ms, or_(ik.c.claim_token.is_(None), ik.c.claim_expires_ms <= now_ms))
            .limit(batch_size)
        )
        async with self.engine.begin() as conn:
            rows = (await conn.execute(chosen)).all()
            for owner, key in rows:
                await conn.execute(delete(ik).where(ik.c.owner == owner, ik.c.key == key, ik.c.expires_ms <= now_ms))
        return len(rows)

    async def erase(self, *, tenant_id: str | None, user_id: str | None) -> int:
        """Delete every key of a tenant, of one `metadata.user_id`, or of both together; how many."""
        criteria = []
        if tenant_id is not None:
            criteria.append(ik.c.tenant_id == tenant_id)
        if user_id is not None:
            criteria.append(ik.c.metadata_user_id == user_id)
        if not criteria:
            raise ValueError("erasure needs at least one criterion")
        async with self.engine.begin() as conn:
            erased = await conn.execute(delete(ik).where(*criteria))
        return int(erased.rowcount)
