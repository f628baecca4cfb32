"""Tenants, their API keys, and retention policies: the same AdminService calls as `/admin/v1` and the CLI."""

from __future__ import annotations

from dataclasses import asdict
from urllib.parse import quote

from fastapi import Request
from fastapi.responses import Response

from statestore.console.policy_form import field_rows, policy_from_form
from statestore.console.web import checked_post, page, redirect, resources_of, router, signed_in
from statestore.errors import StatestoreError
from statestore.store.admin_repository import DEFAULT_SCOPE

NOTICES = {
    "created": "Tenant created.",
    "disabled": "Tenant disabled: its keys are refused until it is enabled again.",
    "enabled": "Tenant enabled.",
    "revoked": "Key revoked: it is refused from now on.",
    "saved": "Policy saved. It governs the next turn.",
    "deleted": "The tenant's own policy is gone: it follows the default now.",
}


def _notice(request: Request) -> str | None:
    return NOTICES.get(request.query_params.get("notice", ""))


@router.get("/tenants")
async def tenants_page(request: Request) -> Response:
    session = await signed_in(request)
    tenants = await resources_of(request).admin.tenants()
    notice = _notice(request)
    return page("tenants.html", session=session, tenants=tenants, error=None, name="", notice=notice, section="tenants")


@router.post("/tenants")
async def create_tenant(request: Request) -> Response:
    session, form = await checked_post(request)
    admin = resources_of(request).admin
    name = form.get("name", "")
    try:
        tenant = await admin.create_tenant(name, actor=session.actor)
    except StatestoreError as error:
        tenants = await admin.tenants()
        return page(
            "tenants.html",
            status=error.status,
            session=session,
            tenants=tenants,
            error=error.message,
            name=name,
            notice=None,
            section="tenants",
        )
    return redirect(f"/tenants/{quote(tenant.id)}?notice=created")


async def _tenant_page(request: Request, tenant_ref: str, *, secret: str | None = None, status: int = 200) -> Response:
    session = await signed_in(request)
    admin = resources_of(request).admin
    tenant = await admin.tenant(tenant_ref)
    return page(
        "tenant.html",
        status=status,
        session=session,
        tenant=tenant,
        keys=await admin.keys(tenant.id),
        stats=await admin.stats(tenant.id),
        secret=secret,
        notice=_notice(request),
        section="tenants",
    )


@router.get("/tenants/{tenant}")
async def tenant_page(request: Request, tenant: str) -> Response:
    return await _tenant_page(request, tenant)


@router.post("/tenants/{tenant}/disable")
async def disable_tenant(request: Request, tenant: str) -> Response:
    session, _ = await checked_post(request)
    changed = await resources_of(request).admin.set_tenant_disabled(tenant, True, actor=session.actor)
    return redirect(f"/tenants/{quote(changed.id)}?notice=disabled")


@router.post("/tenants/{tenant}/enable")
async def enable_tenant(request: Request, tenant: str) -> Response:
    session, _ = await checked_post(request)
    changed = await resources_of(request).admin.set_tenant_disabled(tenant, False, actor=session.actor)
    return redirect(f"/tenants/{quote(changed.id)}?notice=enabled")


@router.post("/tenants/{tenant}/keys")
async def create_key(request: Request, tenant: str) -> Response:
    session, form = await checked_post(request)
    label = form.get("label", "").strip() or None
    created = await resources_of(request).admin.create_key(tenant, label=label, actor=session.actor)
    # The only time the secret is shown: this response is not a redirect, and it is never stored (no-store).
    return await _tenant_page(request, created.key.tenant_id, secret=created.secret, status=201)


@router.post("/keys/{key_id}/revoke")
async def revoke_key(request: Request, key_id: str) -> Response:
    session, _ = await checked_post(request)
    revoked = await resources_of(request).admin.revoke_key(key_id, actor=session.actor)
    return redirect(f"/tenants/{quote(revoked.tenant_id)}?notice=revoked")


# -- policies ----------------------------------------------------------------------------------------------------


async def _policies_page(
    request: Request,
    scope: str,
    *,
    submitted: dict[str, object] | None = None,
    errors: dict[str, str] | None = None,
    status: int = 200,
) -> Response:
    session = await signed_in(request)
    admin = resources_of(request).admin
    tenants = await admin.tenants()
    scope_id = scope if scope == DEFAULT_SCOPE else (await admin.tenant(scope)).id
    layers = await admin.policy_layers(scope_id)
    return page(
        "policies.html",
        status=status,
        session=session,
        tenants=tenants,
        scope=scope_id,
        scope_name=next((t.name for t in tenants if t.id == scope_id), DEFAULT_SCOPE),
        layers=layers,
        rows=field_rows(layers, submitted=submitted, errors=errors),
        form_error=(errors or {}).get(""),
        notice=_notice(request),
        section="policies",
    )


@router.get("/policies")
async def policies_page(request: Request) -> Response:
    return await _policies_page(request, request.query_params.get("scope", DEFAULT_SCOPE) or DEFAULT_SCOPE)


@router.post("/policies/{scope}")
async def put_policy(request: Request, scope: str) -> Response:
    session, form = await checked_post(request)
    policy, submitted, errors = policy_from_form(form)
    if policy is None:
        return await _policies_page(request, scope, submitted=submitted, errors=errors, status=400)
    admin = resources_of(request).admin
    await admin.put_policy(scope, asdict(policy), actor=session.actor)
    return redirect(f"/policies?scope={quote(scope)}&notice=saved")


@router.post("/policies/{scope}/delete")
async def delete_policy(request: Request, scope: str) -> Response:
    session, _ = await checked_post(request)
    await resources_of(request).admin.delete_policy(scope, actor=session.actor)
    return redirect(f"/policies?scope={quote(scope)}&notice=deleted")
