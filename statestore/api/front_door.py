"""The server's outermost ASGI app. The hot routes (api/hot_routes.py: `POST /v1/messages`, `POST /v1/responses`)
are served here through one layer (RequestContextMiddleware: request id, metrics, access log, error bodies in the
route's shape) with the body read under the one limit (middleware.read_body), and no router or dependency solving;
so is WebSocket mode on /v1/responses (api/responses_socket.py); every other request goes to the FastAPI app and its
middleware."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

# Imported for their registrations in HOT_ROUTES.
from statestore.api import messages, openai_responses  # noqa: F401
from statestore.api.hot_routes import HOT_ROUTES, HotHandler
from statestore.api.responses_socket import PATH as SOCKET_PATH
from statestore.api.responses_socket import ResponsesSocket
from statestore.metrics import Metrics
from statestore.middleware import RequestContextMiddleware, RouteResolver, read_body

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer


class _HotRoute:
    """One hot handler as an ASGI app: the body read whole, the handler's response sent."""

    def __init__(self, front_door: FrontDoor, handler: HotHandler) -> None:
        self.front_door = front_door
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await read_body(scope, receive, self.front_door.max_body_bytes)
        if body is None:
            return  # the client went away; nothing will be answered
        query = scope["query_string"].decode("latin-1")
        response = await self.handler(self.front_door.app.state.resources, scope["headers"], query, body)
        await response(scope, receive, send)


def _fixed(route: str) -> RouteResolver:
    """The metrics label of a hot route: its path, known without looking."""

    def resolve(_scope: Scope) -> str:
        return route

    return resolve


class FrontDoor:
    def __init__(
        self,
        app: FastAPI,
        *,
        metrics: Metrics,
        max_body_bytes: int,
        tracer: Tracer | None = None,
        socket_max_seconds: float = 3600.0,
        socket_held_bytes: int = 256 * 1024 * 1024,
        socket_grace_seconds: float = 10.0,
    ) -> None:
        self.app = app
        # WebSocket mode on /v1/responses; every other WebSocket is refused by the FastAPI app (403).
        self.socket = ResponsesSocket(
            app,
            metrics=metrics,
            max_message_bytes=max_body_bytes,
            max_seconds=socket_max_seconds,
            held_bytes=socket_held_bytes,
            grace_seconds=socket_grace_seconds,
        )
        self._rest: ASGIApp = app  # every other request
        self.max_body_bytes = max_body_bytes
        self._hot: dict[str, ASGIApp] = {}
        for path, handler in HOT_ROUTES.items():
            served: ASGIApp = RequestContextMiddleware(_HotRoute(self, handler), metrics, route_resolver=_fixed(path))
            if tracer is not None:
                # Chosen once here: with tracing off, requests run through exactly the objects above.
                from statestore.traced import TracedHttp  # noqa: PLC0415

                served = TracedHttp(served, tracer, route=path)
            self._hot[path] = served
        if tracer is not None:
            from statestore.traced import TracedHttp  # noqa: PLC0415

            self._rest = TracedHttp(app, tracer)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket" and scope["path"] == SOCKET_PATH:
            await self.socket(scope, receive, send)
            return
        if scope["type"] == "http" and scope["method"] == "POST":
            hot = self._hot.get(scope["path"])
            if hot is not None:
                await hot(scope, receive, send)
                return
        await self._rest(scope, receive, send)
