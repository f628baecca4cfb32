"""Administration: the operations behind `/admin/v1` and `statestore admin`, one implementation for both (§8).
Each change is audited: who, when, what, before and after; never message content."""

from __future__ import annotations

import logging
import secrets
import types
import typing
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from statestore.auth import Authenticator, hash_key, new_api_key
from statestore.clock import Clock
from statestore.doors import DOORS, Door
from statestore.erasure_runs import ErasureRuns
from statestore.errors import InvalidRequest, NotFound, StatestoreError
from statestore.policy import Policy
from statestore.policy_fields import FIELD_NAMES, PolicyValueError, validate_values
from statestore.retention import Purged, Retention
from statestore.store.admin_repository import (
    DEFAULT_SCOPE,
    AdminRepository,
    ApiKey,
    AuditEntry,
    AuditFilter,
    Tenant,
)
from statestore.store.erasure_log import ErasureState
from statestore.store.retention_queries import Erasure
from statestore.store.usage_rows import DAY_MS
from statestore.threads.policy_store import PolicyStore

log = logging.getLogger(__name__)

# The policy's field names, in order (their definitions: statestore/policy_fields.py; their types: Policy).
POLICY_FIELDS = FIELD_NAMES
TENANT_ID_PREFIX = "ten_"
MAX_USAGE_DAYS = 366


class Conflict(StatestoreError):
    status = 409
    error_type = "invalid_request_error"


def passthrough_warning(auth_mode: str, what: str) -> str | None:
    """What to tell an operator creating `what` (tenants, keys, tenant policies) where it takes no effect: in
    passthrough mode no request is ever matched to a tenant."""
    if auth_mode != "passthrough":
        return None
    return (
        f"statestore runs in passthrough mode (STATESTORE_AUTH_MODE=passthrough), where {what} take no effect: "
        "requests are never matched to a tenant, and a statestore key (ssk_...) sent by a client is forwarded to the "
        "backend as if it were a backend credential. Set STATESTORE_AUTH_MODE=keys to use tenants, keys and tenant "
        "policies."
    )


@dataclass(frozen=True, slots=True)
class PolicyField:
    """A policy field as a form shows it: its name, its value's kind ("bool", "int", "float", "str", or "choice" with
    its `choices`), and whether it may be left empty (None)."""

    name: str
    kind: str
    optional: bool
    choices: tuple[str, ...] = ()


def policy_fields() -> tuple[PolicyField, ...]:
    """Every field of Policy, read from the dataclass itself, so a field added there reaches every face unchanged."""
    hints = typing.get_type_hints(Policy)
    found = []
    for name in POLICY_FIELDS:
        hint = hints[name]
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        members = typing.get_args(hint) if union else (hint,)
        kinds = [m for m in members if m is not type(None)]
        optional = len(kinds) < len(members)
        literals = [m for m in kinds if typing.get_origin(m) is typing.Literal]
        if int in kinds and len(literals) == 1 and len(kinds) == 2:
            # A number or a word (context_window_tokens: a count or "auto"): a whole number whose choices are words.
            words = tuple(str(choice) for choice in typing.get_args(literals[0]))
            found.append(PolicyField(name=name, kind="int", optional=optional, choices=words))
            continue
        only = kinds[0] if len(kinds) == 1 else str
        if typing.get_origin(only) is typing.Literal:
            choices = tuple(str(choice) for choice in typing.get_args(only))
            found.append(PolicyField(name=name, kind="choice", optional=optional, choices=choices))
            continue
        kind = only.__name__ if only in (bool, int, float, str) else "str"
        found.append(PolicyField(name=name, kind=kind, optional=optional))
    return tuple(found)


@dataclass(frozen=True, slots=True)
class PolicyLayers:
    """Every policy that could govern a scope, most specific first absent ones as None; `effective` and `source`
    are what governs it now ("tenant", "default" or "settings")."""

    tenant: Policy | None
    default: Policy | None
    settings: Policy
    effective: Policy
    source: str


@dataclass(frozen=True, slots=True)
class DoorUsage:
    turns: int
    bytes: int


@dataclass(frozen=True, slots=True)
class DailyUsage:
    """A day's stored turns and bytes, in all and by front door (statestore/doors.py)."""

    day: int  # days since the epoch, UTC
    turns: int
    bytes: int
    doors: dict[Door, DoorUsage]


@dataclass(frozen=True, slots=True)
class CreatedKey:
    key: ApiKey
    secret: str


def validate_policy(values: dict[str, Any]) -> Policy:
    """A policy from untrusted input, every field checked (statestore/policy_fields.py), with messages that name the
    field and say what to change."""
    try:
        return Policy(**validate_values(values))
    except PolicyValueError as exc:
        raise InvalidRequest(str(exc)) from exc


class AdminService:
    def __init__(
        self,
        *,
        repository: AdminRepository,
        policies: PolicyStore,
        retention: Retention,
        authenticator: Authenticator | None,
        clock: Clock,
        erasures: ErasureRuns,
    ) -> None:
        self.repository = repository
        self.policies = policies
        self.retention = retention
        self.authenticator = authenticator
        self.clock = clock
        # The erasures this process runs (for the admin API, the console and the CLI, or taken up), each under a
        # claim that another replica takes over should this process stop.
        self.erasures = erasures

    # -- tenants and keys ----------------------------------------------------------------------------------------

    async def create_tenant(self, name: str, *, actor: str) -> Tenant:
        name = name.strip()
        if not name or len(name) > 200 or name == DEFAULT_SCOPE or not name.isprintable():
            raise InvalidRequest("a tenant name is 1-200 printable characters and not 'default'")
        if name.startswith(TENANT_ID_PREFIX):
            # Tenants are named by id or name alike (routes, CLI, erasure): a name shaped like an id could stand for
            # another tenant.
            raise InvalidRequest(f"a tenant name must not start with {TENANT_ID_PREFIX!r}, which tenant ids use")
        tenant = Tenant(id=TENANT_ID_PREFIX + secrets.token_hex(10), name=name, disabled=False, created_ms=self.clock())
        if not await self.repository.create_tenant(tenant, actor=actor):
            raise Conflict(f"a tenant named {name!r} already exists")
        return tenant

    async def tenants(self) -> list[Tenant]:
        return await self.repository.list_tenants()

    async def tenant(self, id_or_name: str) -> Tenant:
        # Nothing with a NUL or over 200 characters was ever stored: not found, without asking the database.
        tenant = (
            None if "\x00" in id_or_name or len(id_or_name) > 200 else await self.repository.find_tenant(id_or_name)
        )
        if tenant is None:
            raise NotFound(f"no tenant {id_or_name!r}")
        return tenant

    async def set_tenant_disabled(self, id_or_name: str, disabled: bool, *, actor: str) -> Tenant:
        tenant = await self.tenant(id_or_name)
        changed = await self.repository.set_tenant_disabled(tenant, disabled, actor=actor, now_ms=self.clock())
        self._forget_credentials()
        return changed

    async def create_key(self, tenant_ref: str, *, label: str | None, actor: str) -> CreatedKey:
        tenant = await self.tenant(tenant_ref)
        if label is not None and len(label) > 200:
            raise InvalidRequest("a key label is at most 200 characters")
        secret, prefix = new_api_key()
        key = ApiKey(
            id="key_" + secrets.token_hex(10),
            tenant_id=tenant.id,
            label=label,
            prefix=prefix,
            created_ms=self.clock(),
            revoked_ms=None,
        )
        await self.repository.create_key(key, hash_key(secret), actor=actor)
        return CreatedKey(key=key, secret=secret)

    async def keys(self, tenant_ref: str) -> list[ApiKey]:
        tenant = await self.tenant(tenant_ref)
        return await self.repository.list_keys(tenant.id)

    async def revoke_key(self, key_id: str, *, actor: str) -> ApiKey:
        key = await self.repository.find_key(key_id)
        if key is None:
            raise NotFound(f"no API key {key_id!r}")
        revoked = await self.repository.revoke_key(key, actor=actor, now_ms=self.clock())
        self._forget_credentials()
        return revoked

    def _forget_credentials(self) -> None:
        if self.authenticator is not None:
            self.authenticator.forget()

    # -- policies ------------------------------------------------------------------------------------------------

    async def _scope(self, scope: str) -> str:
        return DEFAULT_SCOPE if scope == DEFAULT_SCOPE else (await self.tenant(scope)).id

    async def policy(self, scope: str) -> tuple[Policy, str]:
        """The policy in force for a scope and where it comes from: "tenant", "default" or "settings"."""
        scope_id = await self._scope(scope)
        if scope_id != DEFAULT_SCOPE:
            own = await self.repository.get_policy(scope_id)
            if own is not None:
                return own, "tenant"
        stored = await self.repository.get_policy(DEFAULT_SCOPE)
        return (stored, "default") if stored is not None else (self.policies.fallback, "settings")

    async def policy_layers(self, scope: str) -> PolicyLayers:
        scope_id = await self._scope(scope)
        own = await self.repository.get_policy(scope_id) if scope_id != DEFAULT_SCOPE else None
        default = await self.repository.get_policy(DEFAULT_SCOPE)
        effective, source = await self.policy(scope)
        return PolicyLayers(
            tenant=own, default=default, settings=self.policies.fallback, effective=effective, source=source
        )

    async def put_policy(self, scope: str, values: dict[str, Any], *, actor: str) -> Policy:
        policy = validate_policy(values)
        scope_id = await self._scope(scope)
        before = await self.repository.get_policy(scope_id)
        shortened = await self.repository.put_policy(scope_id, policy, before=before, actor=actor, now_ms=self.clock())
        self.policies.forget()
        await self.retention.forget_shortened(shortened)
        return policy

    async def delete_policy(self, scope: str, *, actor: str) -> None:
        scope_id = await self._scope(scope)
        before = await self.repository.get_policy(scope_id)
        if before is None:
            raise NotFound(f"{scope!r} has no policy of its own")
        # What governs the scope's threads from now on: the stored default for a tenant, else the settings' policy.
        after = await self.repository.get_policy(DEFAULT_SCOPE) if scope_id != DEFAULT_SCOPE else None
        max_ttl_after = (after or self.policies.fallback).max_ttl_seconds
        shortened = await self.repository.delete_policy(
            scope_id, before=before, max_ttl_after=max_ttl_after, actor=actor, now_ms=self.clock()
        )
        self.policies.forget()
        await self.retention.forget_shortened(shortened)

    # -- audit, retention, stats ---------------------------------------------------------------------------------

    async def audit(
        self,
        *,
        limit: int,
        before_id: int | None,
        actor: str | None = None,
        action: str | None = None,
        tenant: str | None = None,
    ) -> tuple[list[AuditEntry], bool]:
        """Up to `limit` entries, newest first, older than `before_id` if given, by `actor`, of `action` (or its
        prefix), about `tenant`; and whether older ones remain."""
        if not 1 <= limit <= 1000:
            raise InvalidRequest("limit must be between 1 and 1000")
        tenant_id = (await self.tenant(tenant)).id if tenant else None
        if "\x00" in (actor or "") + (action or ""):
            # No actor or action with a NUL was ever recorded, and PostgreSQL cannot even compare one.
            return [], False
        filters = AuditFilter(actor=actor or None, action=action or None, tenant_id=tenant_id)
        entries = await self.repository.audit_entries(limit=limit + 1, before_id=before_id, filters=filters)
        return entries[:limit], len(entries) > limit

    async def purge(self, *, actor: str) -> Purged:
        return await self.retention.purge(actor=actor)

    async def erase(self, *, actor: str, tenant: str | None, user_id: str | None) -> ErasureState:
        """Erase now, and return the erasure done (the CLI's: its process lasts as long as the erasure; stopped, the
        erasure is taken up by a server)."""
        state = await self._begin_erasure(actor=actor, tenant=tenant, user_id=user_id)
        return await self.erasures.run(state)

    async def start_erasure(self, *, actor: str, tenant: str | None, user_id: str | None) -> ErasureState:
        """Start an erasure and return it `running`, at once: destroying its data keys is immediate, but deleting its
        rows waits out every replica's remembered keys (STATESTORE_DATA_KEY_CACHE_SECONDS and a commit's time), longer
        than a client waits for an answer. Poll `erasure(id)` until it is `done`."""
        state = await self._begin_erasure(actor=actor, tenant=tenant, user_id=user_id)
        self.erasures.start(state)
        return state

    async def erasure(self, erasure_id: str) -> ErasureState:
        found = (
            await self.erasures.records.get(erasure_id) if len(erasure_id) <= 40 and "\x00" not in erasure_id else None
        )
        if found is None:
            raise NotFound(f"no erasure {erasure_id!r}")
        return found

    async def _begin_erasure(self, *, actor: str, tenant: str | None, user_id: str | None) -> ErasureState:
        if tenant is None and user_id is None:
            raise InvalidRequest("erasure needs a tenant, a user_id, or both")
        tenant_id = (await self.tenant(tenant)).id if tenant is not None else None
        state = ErasureState(
            id="erasure_" + secrets.token_hex(12),
            actor=actor,
            tenant_id=tenant_id,
            user_id=user_id,
            status="running",
            created_ms=self.clock(),
        )
        await self.erasures.begin(state)
        return state

    async def aclose(self) -> None:
        """Stop the erasures still running here: each stays `running`, and another replica takes it up."""
        await self.erasures.aclose()

    async def erasable(self, *, tenant: str | None, user_id: str | None) -> Erasure:
        """How many threads, responses and conversations `erase` with the same criteria would delete now: what a
        confirmation shows."""
        if tenant is None and user_id is None:
            raise InvalidRequest("erasure needs a tenant, a user_id, or both")
        tenant_id = (await self.tenant(tenant)).id if tenant is not None else None
        if user_id is not None and "\x00" in user_id:
            return Erasure(threads=0, responses=0, conversations=0)  # never stored: a NUL cannot be in metadata.user_id
        return await self.retention.queries.count_erasable(tenant_id=tenant_id, user_id=user_id)

    async def daily_usage(self, days: int) -> list[DailyUsage]:
        """Turns and bytes stored on each of the last `days` UTC days, today last, in all and by door; days and doors
        without a turn as zeros."""
        if not 1 <= days <= MAX_USAGE_DAYS:
            raise InvalidRequest(f"days must be between 1 and {MAX_USAGE_DAYS}")
        today = self.clock() // DAY_MS
        counted = await self.repository.daily_usage(since_day=today - days + 1)
        found = []
        for day in range(today - days + 1, today + 1):
            doors = {door: DoorUsage(*counted.get((day, door), (0, 0))) for door in DOORS}
            found.append(
                DailyUsage(
                    day=day,
                    turns=sum(d.turns for d in doors.values()),
                    bytes=sum(d.bytes for d in doors.values()),
                    doors=doors,
                )
            )
        return found

    async def stats(self, tenant: str | None = None) -> dict[str, Any]:
        """Live, awaiting purge, purged and erased counts of both doors, and the purger's last run: as a time
        (`purger_last_run_at`, ISO 8601, None before the first run) and, deprecated, as epoch milliseconds (0 before
        the first run), which clients from before the time was added read."""
        tenant_id = (await self.tenant(tenant)).id if tenant is not None else None
        values = await self.repository.stats(now_ms=self.clock(), tenant_id=tenant_id)
        last_run = values.pop("purger_last_run_ms")
        return {**values, "purger_last_run_at": iso_time(last_run), "purger_last_run_ms": last_run or 0}


def erasure_fields(state: ErasureState) -> dict[str, Any]:
    """An erasure as the admin API and `statestore admin erase --json` report it: the counts once it is done, its
    runs, and when a failed one is run again."""
    erased = state.erased
    return {
        "id": state.id,
        "status": state.status,
        "tenant_id": state.tenant_id,
        "user_id": state.user_id,
        "created_at": iso_time(state.created_ms),
        "finished_at": iso_time(state.finished_ms),
        "erased_threads": erased.threads if erased is not None else None,
        "erased_responses": erased.responses if erased is not None else None,
        "erased_conversations": erased.conversations if erased is not None else None,
        "attempts": state.attempts,
        "retry_at": iso_time(state.retry_at_ms),
    }


def iso_time(ms: int | None) -> str | None:
    """Epoch milliseconds as an ISO 8601 UTC time to the millisecond (2026-12-02T06:15:00.123Z)."""
    if ms is None:
        return None
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def purged_fields(purged: Purged) -> dict[str, int]:
    """A purge's result as the admin API and `statestore purge --json` report it."""
    return {
        "purged_threads": purged.threads,
        "purged_responses": purged.responses,
        "purged_conversations": purged.conversations,
    }


def day_label(day: int) -> str:
    """A day counted since the epoch, as YYYY-MM-DD (UTC)."""
    return (datetime(1970, 1, 1, tzinfo=UTC) + timedelta(days=day)).strftime("%Y-%m-%d")


def as_dict(value: Tenant | ApiKey | AuditEntry | Policy | DailyUsage) -> dict[str, Any]:
    return asdict(value)
