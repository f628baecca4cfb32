"""Sign-in, sign-out, the stylesheet, and the overview: both doors' live, expired, purged and erased counts, daily
turns and bytes by door, the purger's last run (a purge from the console is one too), purge now."""

from __future__ import annotations

from urllib.parse import urlencode

from fastapi import Request
from fastapi.responses import Response

from statestore.admin import DailyUsage
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
from statestore.doors import Door

CHART_DAYS = 30
NOTICES = {"signed-out": "Signed out."}
PURGED_KINDS = ("threads", "responses", "conversations")


@router.get("/static/console.css")
async def stylesheet() -> Response:
    return Response(STYLESHEET, media_type="text/css", headers={**SECURITY_HEADERS, "cache-control": "max-age=3600"})


@router.get("/sign-in")
async def sign_in_page(request: Request) -> Response:
    resources_of(request)
    if await session_of(request) is not None:
        return redirect("")
    notice = NOTICES.get(request.query_params.get("notice", ""))
    return page("sign_in.html", session=None, error=None, notice=notice)


@router.post("/sign-in")
async def sign_in(request: Request) -> Response:
    """Throttled twice: failed attempts per client address (guessing tokens), and sign-ins per token name (a leaked
    token minting sessions). A throttled address is refused before its token is looked at, so it learns nothing."""
    refuse_cross_site(request)
    resources = resources_of(request)
    settings, guard, now = resources.settings, resources.console_guard, resources.clock()
    address = f"address:{request.client.host if request.client else 'unknown'}"
    if await guard.attempts(address, now) >= settings.console_sign_in_failures:
        return _throttled(guard.retry_after_ms(now))
    found = resources.admin_tokens.identify((await form_of(request)).get("token", ""))
    if found is None:
        await guard.count(address, now)
        return page("sign_in.html", status=401, session=None, error="That is not an admin token.", notice=None)
    if await guard.count(f"token:{found[0]}", now) > settings.console_sign_ins_per_token:
        return _throttled(guard.retry_after_ms(now))
    cookie, _ = new_session(*found)
    response = redirect("")
    set_session_cookie(response, request, cookie, SESSION_SECONDS)
    return response


def _throttled(retry_ms: int) -> Response:
    minutes = max(1, -(-retry_ms // 60_000))
    response = page(
        "sign_in.html",
        status=429,
        session=None,
        error=f"Too many sign-in attempts: try again in {minutes} minute{'s' if minutes > 1 else ''}.",
        notice=None,
    )
    response.headers["retry-after"] = str(max(1, -(-retry_ms // 1000)))
    return response


@router.post("/sign-out")
async def sign_out(request: Request) -> Response:
    session, _ = await checked_post(request)
    resources = resources_of(request)
    # Recorded until the cookie would have expired: a copy of it, wherever it went, opens nothing from now on.
    await resources.console_guard.sign_out(session.nonce, session.expires_s * 1000, resources.clock())
    response = redirect("/sign-in?notice=signed-out")
    response.delete_cookie(COOKIE, path=PREFIX, httponly=True, samesite="strict")
    return response


@router.get("")
async def overview(request: Request) -> Response:
    session = await signed_in(request)
    resources = resources_of(request)
    admin = resources.admin
    stats = await admin.stats()
    usage = await admin.daily_usage(CHART_DAYS)
    charts = [
        bar_chart("Turns per day", [(d.day, _by_door(d, "turns")) for d in usage], lambda n: f"{n} turns"),
        bar_chart("Bytes stored per day", [(d.day, _by_door(d, "bytes")) for d in usage], size),
    ]
    notice = _purge_notice(request) or NOTICES.get(request.query_params.get("notice", ""))
    return page(
        "overview.html",
        session=session,
        stats=stats,
        charts=charts,
        notice=notice,
        purge_interval=f"{resources.settings.purge_interval_seconds:g}",
        section="overview",
    )


def _by_door(day: DailyUsage, what: str) -> dict[Door, int]:
    return {door: getattr(usage, what) for door, usage in day.doors.items()}


def _purge_notice(request: Request) -> str | None:
    """What the purge just done deleted, as its redirect carried it; None for anything else (a page marker a person
    edited is not worth an error)."""
    query = request.query_params
    counts = [query.get(kind, "") for kind in PURGED_KINDS]
    if query.get("notice") != "purged" or not all(c.isdigit() and len(c) <= 12 for c in counts):
        return None
    threads, responses, conversations = (int(c) for c in counts)
    return f"Purged {threads} expired threads, {responses} responses and {conversations} conversations."


@router.post("/purge")
async def purge(request: Request) -> Response:
    session, _ = await checked_post(request)
    purged = await resources_of(request).admin.purge(actor=session.actor)
    counts = {"threads": purged.threads, "responses": purged.responses, "conversations": purged.conversations}
    return redirect("?" + urlencode({"notice": "purged", **counts}))
