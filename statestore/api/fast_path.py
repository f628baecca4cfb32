"""`POST /v1/messages`, the hot route, served without FastAPI's router and dependency solving (about a tenth of a
continue's CPU in bench/). Every other request goes through the app as usual."""

from __future__ import annotations

from types import SimpleNamespace

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from statestore.api.deps import Resources
from statestore.api.messages import handle_message

# Stands in for the matched route in the scope, where the metrics middleware reads the route's template.
_ROUTE = SimpleNamespace(path_format="/v1/messages")


class MessagesFastPath:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/v1/messages" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        scope["route"] = _ROUTE
        resources: Resources = scope["app"].state.resources
        # Errors raised here are rendered by RequestContextMiddleware, which wraps this one.
        response = await handle_message(Request(scope, receive), resources)
        await response(scope, receive, send)
