"""The server's outermost ASGI app. `POST /v1/messages` and `POST /v1/responses`, the hot routes, are served here
through one layer (RequestContextMiddleware: request id, metrics, access log, error bodies) with the body limit applied
while the body is read, and no router or dependency solving; every other request goes to the FastAPI app and its
middleware."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from statestore.api.messages import handle_message
from statestore.api.openai_responses import serve_turn
from statestore.errors import RequestTooLarge, StatestoreError
from statestore.metrics import Metrics
from statestore.middleware import RequestContextMiddleware
from statestore.responses.errors import as_openai

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

HOT_ROUTE = "/v1/messages"
RESPONSES_ROUTE = "/v1/responses"


def _hot_route(_scope: Scope) -> str:
    return HOT_ROUTE


def _responses_route(_scope: Scope) -> str:
    return RESPONSES_ROUTE


def _declared_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses a malformed length itself; counting still guards the body
    return None


class FrontDoor:
    def __init__(self, app: FastAPI, *, metrics: Metrics, max_body_bytes: int, tracer: Tracer | None = None) -> None:
        self.app = app
        self._rest: ASGIApp = app  # every other request
        self.max_body_bytes = max_body_bytes
        self._hot: ASGIApp = RequestContextMiddleware(self._messages, metrics, route_resolver=_hot_route)
        self._turns: ASGIApp = RequestContextMiddleware(self._responses, metrics, route_resolver=_responses_route)
        if tracer is not None:
            # Chosen once here: with tracing off, requests run through exactly the objects above.
            from statestore.traced import TracedHttp  # noqa: PLC0415

            self._hot = TracedHttp(self._hot, tracer, route=HOT_ROUTE)
            self._turns = TracedHttp(self._turns, tracer, route=RESPONSES_ROUTE)
            self._rest = TracedHttp(app, tracer)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"]
            if path == HOT_ROUTE:
                await self._hot(scope, receive, send)
                return
            if path == RESPONSES_ROUTE:
                await self._turns(scope, receive, send)
                return
        await self._rest(scope, receive, send)

    async def _messages(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._read_body(scope, receive)
        query = scope["query_string"].decode("latin-1")
        response = await handle_message(self.app.state.resources, scope["headers"], query, body)
        await response(scope, receive, send)

    async def _responses(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await self._read_body(scope, receive)
            response = await serve_turn(self.app.state.resources, scope["headers"], body)
        except StatestoreError as exc:
            raise as_openai(exc) from exc  # the Responses door answers in OpenAI's error shape, as its router did
        await response(scope, receive, send)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        declared = _declared_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            raise self._too_large()  # answered before reading a byte of it
        chunks: list[bytes] = []
        received = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b""  # the client went away; nothing will be answered
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > self.max_body_bytes:
                raise self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _too_large(self) -> RequestTooLarge:
        return RequestTooLarge(f"request body exceeds {self.max_body_bytes} bytes")
