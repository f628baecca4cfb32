"""Sign-in, sign-out, the stylesheet, and the overview: live threads, stored bytes, daily turns and bytes, purge and
erasure totals, the purger's last run."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from statestore.console.charts import bar_chart
from statestore.console.sessions import COOKIE, SESSION_SECONDS, new_session
from statestore.console.web import (
    PREFIX,
    SECURITY_HEADERS,
    STYLESHEET,
    checked_post,
    form_of,
    page,
    redirect,
    refuse_cross_site,
    resources_of,
    router,
    session_of,
    set_session_cookie,
    signed_in,
    size,
)

CHART_DAYS = 30
NOTICES = {
    "purged": "Expired threads purged.",
    "signed-out": "Signed out.",
}


@router.get("/static/console.css")
async def stylesheet() -> Response:
    return Response(STYLESHEET, media_type="text/css", headers={**SECURITY_HEADERS, "cache-control": "max-age=3600"})


@router.get("/sign-in")
async def sign_in_page(request: Request) -> Response:
    resources_of(request)
    if session_of(request) is not None:
        return redirect("")
    notice = NOTICES.get(request.query_params.get("notice", ""))
    return page("sign_in.html", session=None, error=None, notice=notice)


@router.post("/sign-in")
async def sign_in(request: Request) -> Response:
    refuse_cross_site(request)
    tokens = resources_of(request).admin_tokens
    found = tokens.identify((await form_of(request)).get("token", ""))
    if found is None:
        return page("sign_in.html", status=401, session=None, error="That is not an admin token.", notice=None)
    cookie, _ = new_session(*found)
    response = redirect("")
    set_session_cookie(response, request, cookie, SESSION_SECONDS)
    return response


@router.post("/sign-out")
async def sign_out(request: Request) -> Response:
    await checked_post(request)
    response = redirect("/sign-in?notice=signed-out")
    response.delete_cookie(COOKIE, path=PREFIX, httponly=True, samesite="strict")
    return response


@router.get("")
async def overview(request: Request) -> Response:
    session = signed_in(request)
    admin = resources_of(request).admin
    stats = await admin.stats()
    usage = await admin.daily_usage(CHART_DAYS)
    charts = [
        bar_chart("Turns per day", [(d.day, d.turns) for d in usage], lambda n: f"{n} turns"),
        bar_chart("Bytes stored per day", [(d.day, d.bytes) for d in usage], size),
    ]
    notice = NOTICES.get(request.query_params.get("notice", ""))
    return page("overview.html", session=session, stats=stats, charts=charts, notice=notice, section="overview")


@router.post("/purge")
async def purge(request: Request) -> Response:
    session, _ = await checked_post(request)
    await resources_of(request).admin.purge(actor=session.actor)
    return redirect("?notice=purged")
