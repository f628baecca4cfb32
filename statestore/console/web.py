"""What every console page shares: the templates (autoescaped), the security headers, the session of a request, and
the checks every form post passes (same origin, CSRF token)."""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping
from datetime import UTC, datetime
from importlib import resources as package_files
from typing import Any
from urllib.parse import parse_qsl

import jinja2
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.routing import APIRoute

from statestore.console.sessions import COOKIE, ConsoleSession, csrf_matches, read_session
from statestore.errors import StatestoreError
from statestore.resources import Resources

PREFIX = "/admin/console"

# Nothing runs in a console page: no script at all, styles only from the console's own stylesheet, forms only to
# itself, and no framing (clickjacking). The charts are inline SVG drawn with attributes, which CSP does not govern.
CSP = (
    "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "same-origin",
    "cache-control": "no-store",
    "cross-origin-opener-policy": "same-origin",
}

templates = jinja2.Environment(
    loader=jinja2.PackageLoader("statestore.console", "templates"),
    autoescape=True,  # every value is escaped unless a template says otherwise, and none does
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)
STYLESHEET = (package_files.files("statestore.console") / "static" / "console.css").read_bytes()


def when(ms: int | None) -> str:
    if not ms:
        return "never"
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def when_iso(at: str | None) -> str:
    """An ISO 8601 time (as the admin API gives it) the way `when` shows one."""
    if not at:
        return "never"
    return datetime.fromisoformat(at).astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def size(count: int) -> str:
    value = float(count)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1024 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{count} B"


def shown(value: object) -> str:
    """A policy value as the API spells it (true/false, not Python's True/False); "—" for a layer that is absent."""
    if value is None:
        return "—"
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


templates.filters["when"] = when
templates.filters["when_iso"] = when_iso
templates.filters["shown"] = shown
templates.filters["size"] = size


class ConsoleRefusal(Exception):
    """A request the console will not serve: rendered as a plain page with this status, never as an API error."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def page(template: str, status: int = 200, **context: Any) -> HTMLResponse:
    html = templates.get_template(template).render(**{"prefix": PREFIX, "notice": None, "section": "", **context})
    return HTMLResponse(html, status_code=status, headers=SECURITY_HEADERS)


def refusal_page(refusal: ConsoleRefusal) -> HTMLResponse:
    return page("refused.html", status=refusal.status, message=refusal.message, session=None)


async def signed_in(request: Request) -> ConsoleSession:
    """The session of a page view; without one, a refusal that sends the browser to the sign-in page."""
    session = await session_of(request)
    if session is None:
        raise SignInFirst
    return session


class SignInFirst(Exception):
    """A page viewed without a session: answered with a redirect to the sign-in page."""


def redirect(path: str) -> RedirectResponse:
    return RedirectResponse(PREFIX + path, status_code=303, headers=SECURITY_HEADERS)


def resources_of(request: Request) -> Resources:
    resources: Resources = request.app.state.resources
    if not resources.admin_tokens.configured:
        # Off unless admin tokens are configured: as if it did not exist.
        raise ConsoleRefusal(404, "The console is off: set STATESTORE_ADMIN_TOKENS to turn it on.")
    return resources


async def session_of(request: Request) -> ConsoleSession | None:
    """The session the request's cookie stands for, unless it was signed out."""
    resources = resources_of(request)
    session = read_session(resources.admin_tokens, request.cookies.get(COOKIE))
    if session is None or await resources.console_guard.signed_out(session.nonce):
        return None
    return session


def refuse_cross_site(request: Request) -> None:
    """A form post must come from a console page: the browser says where it came from in Sec-Fetch-Site and Origin.
    (The session cookie is SameSite=Strict as well, so a cross-site post arrives signed out.)"""
    fetch_site = request.headers.get("sec-fetch-site")
    if fetch_site is not None and fetch_site not in ("same-origin", "none"):
        raise ConsoleRefusal(403, "Refused: this form was posted from another site.")
    origin = request.headers.get("origin")
    own = f"{request.url.scheme}://{request.headers.get('host', '')}"
    if origin is not None and origin != own:
        raise ConsoleRefusal(403, "Refused: this form was posted from another origin.")


async def form_of(request: Request) -> dict[str, str]:
    """An urlencoded form's fields (the last value of a repeated one); the body size is bounded by the middleware."""
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/x-www-form-urlencoded":
        raise ConsoleRefusal(415, "Refused: a console form is posted as application/x-www-form-urlencoded.")
    body = (await request.body()).decode("utf-8", errors="replace")
    return dict(parse_qsl(body, keep_blank_values=True, max_num_fields=200))


async def checked_post(request: Request) -> tuple[ConsoleSession, dict[str, str]]:
    """The session and form of a post that changes something: same origin, signed in, and the session's CSRF token."""
    refuse_cross_site(request)
    session = await session_of(request)
    if session is None:
        raise ConsoleRefusal(401, "Your console session has ended: sign in again.")
    form = await form_of(request)
    if not csrf_matches(session, form.get("csrf")):
        raise ConsoleRefusal(403, "Refused: the form's CSRF token is missing or wrong. Reload the page and retry.")
    return session, form


def set_session_cookie(response: Response, request: Request, value: str, max_age: int) -> None:
    response.set_cookie(
        COOKIE,
        value,
        max_age=max_age,
        path=PREFIX,
        httponly=True,
        secure=request.url.scheme == "https",
        samesite="strict",
    )


def query_of(request: Request, *names: str) -> Mapping[str, str]:
    return {name: request.query_params.get(name, "").strip() for name in names}


class ConsoleRoute(APIRoute):
    """Every console route answers in HTML: a refusal or an error of the admin service becomes a page, never the
    API's JSON error body."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def answer(request: Request) -> Response:
            try:
                return await handler(request)
            except SignInFirst:
                return redirect("/sign-in")
            except ConsoleRefusal as refusal:
                return refusal_page(refusal)
            except StatestoreError as error:
                session = await session_of(request)
                return page("refused.html", status=error.status, message=error.message, session=session)

        return answer


router = APIRouter(prefix=PREFIX, include_in_schema=False, route_class=ConsoleRoute)
