"""`/admin/v1`: tenants, API keys, retention policies, audit, purge, erasure, stats (docs/protocol.md §8).

Guarded by the admin tokens of STATESTORE_ADMIN_TOKENS (`Authorization: Bearer`); a tenant credential is refused."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field, create_model

from statestore.admin import AdminService, as_dict, day_label, erasure_fields, passthrough_warning, purged_fields
from statestore.api import schemas
from statestore.api.deps import ResourcesDep
from statestore.errors import AuthenticationFailed, PermissionDenied
from statestore.policy import Policy
from statestore.policy_fields import POLICY_FIELDS
from statestore.resources import Resources

router = APIRouter(prefix="/admin/v1", tags=["admin"], responses=schemas.error_responses(400, 401, 403, 404, 503))


def admin_actor(request: Request, resources: ResourcesDep) -> str:
    if not resources.admin_tokens.configured:
        raise PermissionDenied("the admin API is off: set STATESTORE_ADMIN_TOKENS to enable it")
    actor = resources.admin_tokens.actor(request.headers.raw)
    if actor is None:
        raise AuthenticationFailed("an admin token is required (Authorization: Bearer)")
    return actor


def admin_service(resources: ResourcesDep) -> AdminService:
    return resources.admin


Actor = Annotated[str, Depends(admin_actor)]
Admin = Annotated[AdminService, Depends(admin_service)]


class TenantIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=200)


class KeyIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    label: str | None = Field(default=None, max_length=200)


# The request model of a policy update, derived from the one definition of the fields (statestore/policy_fields.py).
PolicyIn = create_model(
    "PolicyIn",
    __config__=ConfigDict(extra="forbid", strict=True),
    **{f.name: (f.python_type, ... if f.required else f.default) for f in POLICY_FIELDS},  # type: ignore[call-overload]
)


class EraseIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant: str | None = None
    user_id: str | None = Field(default=None, min_length=1, max_length=256)


def _policy_view(scope: str, policy: Policy, source: str) -> dict[str, Any]:
    return {"scope": scope, "source": source, "policy": as_dict(policy)}


def _warned(value: dict[str, Any], resources: Resources, what: str) -> dict[str, Any]:
    # Only in passthrough mode: the field is absent otherwise (the routes exclude unset fields).
    warning = passthrough_warning(resources.settings.auth_mode, what)
    return {**value, "warning": warning} if warning is not None else value


@router.get("/tenants", response_model=schemas.TenantList)
async def list_tenants(actor: Actor, admin: Admin) -> dict[str, Any]:
    return {"data": [as_dict(t) for t in await admin.tenants()]}


@router.post(
    "/tenants",
    status_code=201,
    # Unset fields (the warning, outside passthrough mode) are left out.
    response_model=schemas.CreatedTenant,
    response_model_exclude_unset=True,
    responses=schemas.error_responses(409),
)
async def create_tenant(body: TenantIn, actor: Actor, admin: Admin, resources: ResourcesDep) -> dict[str, Any]:
    return _warned(as_dict(await admin.create_tenant(body.name, actor=actor)), resources, "tenants")


@router.get("/tenants/{tenant}", response_model=schemas.Tenant)
async def get_tenant(tenant: str, actor: Actor, admin: Admin) -> dict[str, Any]:
    return as_dict(await admin.tenant(tenant))


@router.post("/tenants/{tenant}/disable", response_model=schemas.Tenant)
async def disable_tenant(tenant: str, actor: Actor, admin: Admin) -> dict[str, Any]:
    return as_dict(await admin.set_tenant_disabled(tenant, True, actor=actor))


@router.post("/tenants/{tenant}/enable", response_model=schemas.Tenant)
async def enable_tenant(tenant: str, actor: Actor, admin: Admin) -> dict[str, Any]:
    return as_dict(await admin.set_tenant_disabled(tenant, False, actor=actor))


@router.get("/tenants/{tenant}/keys", response_model=schemas.ApiKeyList)
async def list_keys(tenant: str, actor: Actor, admin: Admin) -> dict[str, Any]:
    return {"data": [as_dict(k) for k in await admin.keys(tenant)]}


@router.post(
    "/tenants/{tenant}/keys",
    status_code=201,
    response_model=schemas.CreatedApiKey,
    response_model_exclude_unset=True,
)
async def create_key(
    tenant: str, actor: Actor, admin: Admin, resources: ResourcesDep, body: KeyIn | None = None
) -> dict[str, Any]:
    # The body is optional: a key needs no label.
    created = await admin.create_key(tenant, label=body.label if body is not None else None, actor=actor)
    # The only time the secret is shown.
    return _warned({**as_dict(created.key), "secret": created.secret}, resources, "API keys")


@router.delete("/keys/{key_id}", response_model=schemas.ApiKey)
async def revoke_key(key_id: str, actor: Actor, admin: Admin) -> dict[str, Any]:
    return as_dict(await admin.revoke_key(key_id, actor=actor))


@router.get("/policies/{scope}", response_model=schemas.PolicyView)
async def get_policy(scope: str, actor: Actor, admin: Admin) -> dict[str, Any]:
    policy, source = await admin.policy(scope)
    return _policy_view(scope, policy, source)


@router.get("/policy-fields", response_model=schemas.PolicyFields)
async def policy_fields(actor: Actor) -> dict[str, Any]:
    """The policy's fields as data (name, kind, limits, default, help), so a form can be rendered from them."""
    return {"data": [field.describe() for field in POLICY_FIELDS]}


@router.put("/policies/{scope}", response_model=schemas.PolicySet, response_model_exclude_unset=True)
async def put_policy(scope: str, body: PolicyIn, actor: Actor, admin: Admin, resources: ResourcesDep) -> dict[str, Any]:
    policy = await admin.put_policy(scope, body.model_dump(), actor=actor)
    view = _policy_view(scope, policy, "default" if scope == "default" else "tenant")
    return view if scope == "default" else _warned(view, resources, "tenant policies")


@router.delete("/policies/{scope}", response_model=schemas.PolicyView)
async def delete_policy(scope: str, actor: Actor, admin: Admin) -> dict[str, Any]:
    await admin.delete_policy(scope, actor=actor)
    policy, source = await admin.policy(scope)
    return _policy_view(scope, policy, source)


@router.get("/audit", response_model=schemas.AuditPage)
async def audit(
    *,
    actor: Actor,
    admin: Admin,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    before: Annotated[int | None, Query(ge=1, le=2**31 - 1)] = None,
    by: Annotated[str | None, Query(alias="actor", max_length=200)] = None,
    action: Annotated[str | None, Query(max_length=100)] = None,
    tenant: Annotated[str | None, Query(max_length=200)] = None,
) -> dict[str, Any]:
    entries, has_more = await admin.audit(limit=limit, before_id=before, actor=by, action=action, tenant=tenant)
    return {"data": [as_dict(e) for e in entries], "has_more": has_more}


@router.post("/purge", response_model=schemas.Purged)
async def purge(actor: Actor, admin: Admin) -> dict[str, int]:
    return purged_fields(await admin.purge(actor=actor))


@router.post("/erase", status_code=202, response_model=schemas.Erasure)
async def erase(body: EraseIn, actor: Actor, admin: Admin, response: Response) -> dict[str, Any]:
    """Starts the erasure and answers at once, `running`: poll `GET /admin/v1/erasures/{id}` (the `location`) until
    it is `done`, when nothing it erased is readable on any replica."""
    state = await admin.start_erasure(actor=actor, tenant=body.tenant, user_id=body.user_id)
    response.headers["location"] = f"/admin/v1/erasures/{state.id}"
    return erasure_fields(state)


@router.get("/erasures/{erasure_id}", response_model=schemas.Erasure)
async def erasure(erasure_id: str, actor: Actor, admin: Admin) -> dict[str, Any]:
    return erasure_fields(await admin.erasure(erasure_id))


@router.get("/usage", response_model=schemas.UsagePage)
async def usage(
    actor: Actor, admin: Admin, days: Annotated[int, Query(ge=1, le=366)] = 30
) -> dict[str, list[dict[str, Any]]]:
    """Turns and bytes stored on each of the last `days` UTC days, oldest first, in all and by front door, counted
    as each turn commits."""
    return {"data": [{**as_dict(d), "day": day_label(d.day)} for d in await admin.daily_usage(days)]}


@router.get("/stats", response_model=schemas.Stats)
async def stats(actor: Actor, admin: Admin, tenant: str | None = None) -> dict[str, Any]:
    return await admin.stats(tenant)
