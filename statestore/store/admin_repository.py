"""All SQL for administration: tenants, API keys, retention policies, the audit log and counters.

Every change writes its audit entry in the same transaction, so the log cannot miss a change that happened.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import orjson
from sqlalchemy import and_, delete, func, insert, not_, or_, select, update
from sqlalchemy.engine import RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from statestore.policy import Policy
from statestore.policy_fields import POLICY_FIELDS
from statestore.records import record
from statestore.store.audit_filter import AuditFilter
from statestore.store.responses_stats import responses_stats
from statestore.store.schema import (
    api_keys,
    audit_log,
    conversations,
    counters,
    daily_usage,
    policies,
    responses,
    tenants,
    threads,
)

DEFAULT_SCOPE = "default"

__all__ = ["DEFAULT_SCOPE", "AdminRepository", "ApiKey", "AuditEntry", "AuditFilter", "KeyOwner", "Tenant"]


@dataclass(frozen=True, slots=True)
class Tenant:
    id: str
    name: str
    disabled: bool
    created_ms: int


@dataclass(frozen=True, slots=True)
class ApiKey:
    id: str
    tenant_id: str
    label: str | None
    prefix: str
    created_ms: int
    revoked_ms: int | None


@dataclass(frozen=True, slots=True)
class KeyOwner:
    key_id: str
    tenant_id: str
    tenant_name: str


@dataclass(frozen=True, slots=True)
class AuditEntry:
    id: int
    at_ms: int
    actor: str
    action: str
    target: str | None
    before: Any
    after: Any


def _tenant(row: RowMapping) -> Tenant:
    return Tenant(id=row["id"], name=row["name"], disabled=bool(row["disabled"]), created_ms=row["created_ms"])


def _key(row: RowMapping) -> ApiKey:
    return ApiKey(
        id=row["id"],
        tenant_id=row["tenant_id"],
        label=row["label"],
        prefix=row["prefix"],
        created_ms=row["created_ms"],
        revoked_ms=row["revoked_ms"],
    )


def _policy(row: RowMapping) -> Policy:
    values: dict[str, Any] = {f.name: f.from_column(row[f.name]) for f in POLICY_FIELDS}
    return Policy(**values)


def _json(value: Any) -> str | None:
    return None if value is None else orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


@record
class Shortened:
    """The live threads and responses a policy's lower maximum TTL shortened: the cache keeps rows of theirs (a
    thread's head row, a chain's head) with the expiry they had, to be forgotten."""

    threads: list[str]
    responses: list[str]


class AdminRepository:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def _audit(
        self,
        conn: AsyncConnection,
        *,
        actor: str,
        action: str,
        target: str | None,
        before: Any,
        after: Any,
        now_ms: int,
    ) -> None:
        await conn.execute(
            insert(audit_log).values(
                at_ms=now_ms, actor=actor, action=action, target=target, before=_json(before), after=_json(after)
            )
        )

    # -- tenants -------------------------------------------------------------------------------------------------

    async def create_tenant(self, tenant: Tenant, *, actor: str) -> bool:
        """False when the name is taken."""
        async with self.engine.begin() as conn:
            taken = (await conn.execute(select(tenants.c.id).where(tenants.c.name == tenant.name))).first()
            if taken is not None:
                return False
            await conn.execute(insert(tenants).values(**asdict(tenant)))
            await self._audit(
                conn,
                actor=actor,
                action="tenant.create",
                target=tenant.id,
                before=None,
                after=asdict(tenant),
                now_ms=tenant.created_ms,
            )
        return True

    async def list_tenants(self) -> list[Tenant]:
        async with self.engine.connect() as conn:
            rows = (await conn.execute(select(tenants).order_by(tenants.c.created_ms, tenants.c.id))).mappings()
            return [_tenant(row) for row in rows]

    async def find_tenant(self, id_or_name: str) -> Tenant | None:
        """The tenant with this id, else the one with this name."""
        stmt = (
            select(tenants)
            .where(or_(tenants.c.id == id_or_name, tenants.c.name == id_or_name))
            .order_by((tenants.c.id == id_or_name).desc())
            .limit(1)
        )
        async with self.engine.connect() as conn:
            row = (await conn.execute(stmt)).mappings().first()
        return _tenant(row) if row is not None else None

    async def set_tenant_disabled(self, tenant: Tenant, disabled: bool, *, actor: str, now_ms: int) -> Tenant:
        async with self.engine.begin() as conn:
            await conn.execute(update(tenants).where(tenants.c.id == tenant.id).values(disabled=disabled))
            changed = Tenant(id=tenant.id, name=tenant.name, disabled=disabled, created_ms=tenant.created_ms)
            await self._audit(
                conn,
                actor=actor,
                action="tenant.disable" if disabled else "tenant.enable",
                target=tenant.id,
                before=asdict(tenant),
                after=asdict(changed),
                now_ms=now_ms,
            )
        return changed

    # -- API keys ------------------------------------------------------------------------------------------------

    async def create_key(self, key: ApiKey, key_hash: str, *, actor: str) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(insert(api_keys).values(**asdict(key), key_hash=key_hash))
            await self._audit(
                conn,
                actor=actor,
                action="key.create",
                target=key.id,
                before=None,
                after=asdict(key),
                now_ms=key.created_ms,
            )

    async def list_keys(self, tenant_id: str) -> list[ApiKey]:
        stmt = select(api_keys).where(api_keys.c.tenant_id == tenant_id).order_by(api_keys.c.created_ms)
        async with self.engine.connect() as conn:
            return [_key(row) for row in (await conn.execute(stmt)).mappings()]

    async def find_key(self, key_id: str) -> ApiKey | None:
        async with self.engine.connect() as conn:
            row = (await conn.execute(select(api_keys).where(api_keys.c.id == key_id))).mappings().first()
        return _key(row) if row is not None else None

    async def revoke_key(self, key: ApiKey, *, actor: str, now_ms: int) -> ApiKey:
        async with self.engine.begin() as conn:
            await conn.execute(
                update(api_keys)
                .where(api_keys.c.id == key.id, api_keys.c.revoked_ms.is_(None))
                .values(revoked_ms=now_ms)
            )
            row = (await conn.execute(select(api_keys).where(api_keys.c.id == key.id))).mappings().one()
            revoked = _key(row)
            await self._audit(
                conn,
                actor=actor,
                action="key.revoke",
                target=key.id,
                before=asdict(key),
                after=asdict(revoked),
                now_ms=now_ms,
            )
        return revoked

    async def owner_of_key(self, key_hash: str) -> KeyOwner | None:
        """The tenant a live key belongs to; None for an unknown or revoked key, or a disabled tenant."""
        stmt = (
            select(api_keys.c.id, api_keys.c.tenant_id, tenants.c.name)
            .join(tenants, tenants.c.id == api_keys.c.tenant_id)
            .where(api_keys.c.key_hash == key_hash, api_keys.c.revoked_ms.is_(None), not_(tenants.c.disabled))
        )
        async with self.engine.connect() as conn:
            row = (await conn.execute(stmt)).first()
        return KeyOwner(key_id=row[0], tenant_id=row[1], tenant_name=row[2]) if row is not None else None

    # -- policies ------------------------------------------------------------------------------------------------

    async def get_policy(self, scope: str) -> Policy | None:
        async with self.engine.connect() as conn:
            row = (await conn.execute(select(policies).where(policies.c.scope == scope))).mappings().first()
        return _policy(row) if row is not None else None

    async def all_policies(self) -> dict[str, Policy]:
        async with self.engine.connect() as conn:
            return {row["scope"]: _policy(row) for row in (await conn.execute(select(policies))).mappings()}

    async def put_policy(
        self, scope: str, policy: Policy, *, before: Policy | None, actor: str, now_ms: int
    ) -> Shortened:
        """Store the policy and shorten the live threads, responses and conversations it now allows less time, in one
        transaction. Returns what it shortened (their cached rows carry the old expiry)."""
        values = {**{f.name: f.to_column(getattr(policy, f.name)) for f in POLICY_FIELDS}, "updated_ms": now_ms}
        async with self.engine.begin() as conn:
            changed = await conn.execute(update(policies).where(policies.c.scope == scope).values(**values))
            if changed.rowcount == 0:
                await conn.execute(insert(policies).values(scope=scope, **values))
            shortened = await self._shorten(conn, scope, policy.max_ttl_seconds)
            await self._audit(
                conn,
                actor=actor,
                action="policy.put",
                target=scope,
                before=asdict(before) if before is not None else None,
                after=asdict(policy),
                now_ms=now_ms,
            )
        return shortened

    async def delete_policy(
        self, scope: str, *, before: Policy, max_ttl_after: int, actor: str, now_ms: int
    ) -> Shortened:
        """Drop the scope's own policy; what it governed now follows a policy allowing at most `max_ttl_after`
        seconds, and live threads, responses and conversations allowed more are shortened, in the same transaction.
        Returns what it shortened."""
        async with self.engine.begin() as conn:
            await conn.execute(delete(policies).where(policies.c.scope == scope))
            shortened = await self._shorten(conn, scope, max_ttl_after)
            await self._audit(
                conn,
                actor=actor,
                action="policy.delete",
                target=scope,
                before=asdict(before),
                after=None,
                now_ms=now_ms,
            )
        return shortened

    async def _shorten(self, conn: AsyncConnection, scope: str, max_ttl_seconds: int) -> Shortened:
        """Bring what a scope's policy governs within its maximum TTL, at once, on both doors (docs/policies.md):
        threads from their last stored reply, responses and conversations from their creation (their TTL counts
        from there). Returns what it shortened."""
        least = func.min if self.engine.dialect.name == "sqlite" else func.least
        shortened = await self._shorten_threads(conn, scope, max_ttl_seconds)
        for table in (responses, conversations):
            allowed = table.c.created_ms + max_ttl_seconds * 1000
            changed = await conn.execute(
                update(table)
                .where(self._governed_by(table, scope), table.c.expires_ms > allowed)
                .values(expires_ms=least(table.c.expires_ms, allowed))
                .returning(table.c.id)
            )
            if table is responses:
                shortened.responses.extend(row[0] for row in changed)
        return shortened

    async def _shorten_threads(self, conn: AsyncConnection, scope: str, max_ttl_seconds: int) -> Shortened:
        """Bring the live threads a scope's policy governs within its maximum TTL, at once (docs/protocol.md §8)."""
        shortened = threads.c.updated_ms + max_ttl_seconds * 1000
        least = func.min if self.engine.dialect.name == "sqlite" else func.least
        changed = await conn.execute(
            update(threads)
            .where(self._governed_by(threads, scope), threads.c.ttl_seconds > max_ttl_seconds)
            .values(ttl_seconds=max_ttl_seconds, expires_ms=least(threads.c.expires_ms, shortened))
            .returning(threads.c.id)
        )
        return Shortened(threads=[row[0] for row in changed], responses=[])

    @staticmethod
    def _governed_by(table: Any, scope: str) -> Any:
        """The rows (threads, responses, conversations) a scope's policy governs."""
        if scope != DEFAULT_SCOPE:
            return table.c.tenant_id == scope
        # The default policy governs every row whose tenant has no policy of its own.
        return or_(
            table.c.tenant_id.is_(None),
            table.c.tenant_id.not_in(select(policies.c.scope).where(policies.c.scope != DEFAULT_SCOPE)),
        )

    # -- audit and counters --------------------------------------------------------------------------------------

    async def record(self, *, actor: str, action: str, target: str | None, after: Any, now_ms: int) -> None:
        """An audit entry for an operation that changes data but no setting (purge, erasure)."""
        async with self.engine.begin() as conn:
            await self._audit(conn, actor=actor, action=action, target=target, before=None, after=after, now_ms=now_ms)

    async def audit_entries(
        self, *, limit: int, before_id: int | None = None, filters: AuditFilter | None = None
    ) -> list[AuditEntry]:
        """Newest first."""
        stmt = select(audit_log).order_by(audit_log.c.id.desc()).limit(limit)
        if before_id is not None:
            stmt = stmt.where(audit_log.c.id < before_id)
        if filters is not None:
            stmt = stmt.where(*filters.criteria())
        async with self.engine.connect() as conn:
            rows = (await conn.execute(stmt)).mappings().all()
        return [
            AuditEntry(
                id=row["id"],
                at_ms=row["at_ms"],
                actor=row["actor"],
                action=row["action"],
                target=row["target"],
                before=orjson.loads(row["before"]) if row["before"] is not None else None,
                after=orjson.loads(row["after"]) if row["after"] is not None else None,
            )
            for row in rows
        ]

    async def set_counter(self, name: str, value: int) -> None:
        async with self.engine.begin() as conn:
            changed = await conn.execute(update(counters).where(counters.c.name == name).values(value=value))
            if changed.rowcount == 0:
                await conn.execute(insert(counters).values(name=name, value=value))

    async def daily_usage(self, *, since_day: int) -> dict[tuple[int, str], tuple[int, int]]:
        """(day since the epoch, door) → (turns, bytes stored), for the days from `since_day` that saw a turn."""
        stmt = (
            select(daily_usage.c.day, daily_usage.c.door, func.sum(daily_usage.c.turns), func.sum(daily_usage.c.bytes))
            .where(daily_usage.c.day >= since_day)
            .group_by(daily_usage.c.day, daily_usage.c.door)
        )
        async with self.engine.connect() as conn:
            return {(int(day), door): (int(turns), int(size)) for day, door, turns, size in await conn.execute(stmt)}

    async def add_to_counter(self, name: str, amount: int) -> None:
        if amount == 0:
            return
        async with self.engine.begin() as conn:
            changed = await conn.execute(
                update(counters).where(counters.c.name == name).values(value=counters.c.value + amount)
            )
            if changed.rowcount == 0:
                await conn.execute(insert(counters).values(name=name, value=amount))

    async def stats(self, *, now_ms: int, tenant_id: str | None = None) -> dict[str, int | None]:
        live = and_(threads.c.expires_ms > now_ms, threads.c.head_message_id.is_not(None))
        expired = threads.c.expires_ms <= now_ms
        if tenant_id is not None:
            live = and_(live, threads.c.tenant_id == tenant_id)
            expired = and_(expired, threads.c.tenant_id == tenant_id)
        async with self.engine.connect() as conn:
            count, size, messages = (
                await conn.execute(
                    select(
                        func.count(),
                        func.coalesce(func.sum(threads.c.byte_count), 0),
                        func.coalesce(func.sum(threads.c.head_position), 0),
                    ).where(live)
                )
            ).one()
            awaiting_purge = (await conn.execute(select(func.count()).select_from(threads).where(expired))).scalar_one()
            totals = {row[0]: row[1] for row in await conn.execute(select(counters.c.name, counters.c.value))}
            front_door = await responses_stats(conn, now_ms=now_ms, tenant_id=tenant_id, totals=totals)
        return {
            "live_threads": int(count),
            "live_messages": int(messages),
            "live_bytes": int(size),
            "expired_awaiting_purge": int(awaiting_purge),
            "purged_threads_total": int(totals.get("purged_threads", 0)),
            "erased_threads_total": int(totals.get("erased_threads", 0)),
            # None until a purge (the background purger's or an admin's) has run against this database.
            "purger_last_run_ms": totals.get("purger_last_run_ms"),
            **front_door,
        }
