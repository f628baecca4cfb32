"""The audit log (paged, filtered) and erasure (with a confirmation that counts what it will delete, then its state
until it is done)."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from statestore.console.audit_changes import changes, full_record
from statestore.console.web import checked_post, page, query_of, redirect, resources_of, router, signed_in
from statestore.errors import InvalidRequest, StatestoreError

AUDIT_PAGE = 50


@router.get("/audit")
async def audit_page(request: Request) -> Response:
    session = await signed_in(request)
    filters = query_of(request, "actor", "action", "tenant")
    before_text = request.query_params.get("before", "")
    # Audit ids are 32-bit: anything else is no page marker (the newest page).
    before = int(before_text) if before_text.isdigit() and len(before_text) <= 10 else None
    before = before if before is not None and 0 < before < 2**31 else None
    admin = resources_of(request).admin
    entries, has_more = await admin.audit(
        limit=AUDIT_PAGE,
        before_id=before,
        actor=filters["actor"] or None,
        action=filters["action"] or None,
        tenant=filters["tenant"] or None,
    )
    rows = [
        {
            "entry": entry,
            "changes": changes(entry.before, entry.after),
            "before": full_record(entry.before),
            "after": full_record(entry.after),
        }
        for entry in entries
    ]
    return page(
        "audit.html",
        session=session,
        rows=rows,
        filters=filters,
        has_more=has_more,
        older=entries[-1].id if entries and has_more else None,
        paged=before is not None,
        section="audit",
    )


def _criteria(form: dict[str, str]) -> tuple[str | None, str | None]:
    tenant = form.get("tenant", "").strip() or None
    user_id = form.get("user_id", "").strip() or None
    if user_id is not None and (len(user_id) > 256 or "\x00" in user_id):
        raise InvalidRequest("a user_id is at most 256 characters, none of them NUL")
    return tenant, user_id


@router.get("/erasure")
async def erasure_page(request: Request) -> Response:
    session = await signed_in(request)
    tenants = await resources_of(request).admin.tenants()
    return page("erasure.html", session=session, tenants=tenants, error=None, tenant="", user_id="", section="erasure")


@router.post("/erasure/preview")
async def erasure_preview(request: Request) -> Response:
    """The confirmation: how many threads, responses and conversations the erasure would delete now, and a button that
    does it."""
    session, form = await checked_post(request)
    admin = resources_of(request).admin
    tenant, user_id = _criteria(form)
    try:
        counts = await admin.erasable(tenant=tenant, user_id=user_id)
        tenant_name = (await admin.tenant(tenant)).name if tenant is not None else None
    except StatestoreError as error:
        return page(
            "erasure.html",
            status=error.status,
            session=session,
            tenants=await admin.tenants(),
            error=error.message,
            tenant=tenant or "",
            user_id=user_id or "",
            section="erasure",
        )
    return page(
        "erasure_confirm.html",
        session=session,
        counts=counts,
        tenant=tenant,
        tenant_name=tenant_name,
        user_id=user_id,
        section="erasure",
    )


@router.post("/erasure")
async def erase(request: Request) -> Response:
    session, form = await checked_post(request)
    tenant, user_id = _criteria(form)
    state = await resources_of(request).admin.start_erasure(actor=session.actor, tenant=tenant, user_id=user_id)
    return redirect(f"/erasure/{state.id}")


@router.get("/erasure/{erasure_id}")
async def erasure_state(request: Request, erasure_id: str) -> Response:
    """An erasure's state: reloaded every second while it runs; once done, what it erased."""
    session = await signed_in(request)
    state = await resources_of(request).admin.erasure(erasure_id)
    return page("erasure_state.html", session=session, erasure=state, section="erasure")
