"""Pure-ASGI middleware: request ids, access log and metrics, last-resort error bodies, body size limit.

Pure ASGI (never BaseHTTPMiddleware) so a streamed response passes through chunk by chunk, with no
extra task and no buffering, and so `send` can be watched to the last byte.

Wiring, outermost first (Starlette's `add_middleware` puts the last one added outermost):

    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestContextMiddleware, metrics=metrics)

`add_middleware` places both inside Starlette's ServerErrorMiddleware and outside its
ExceptionMiddleware, so an unhandled exception reaches RequestContextMiddleware, which answers with an
error body before ServerErrorMiddleware could send its plain-text or HTML 500.

An outage (a database or Redis that cannot be reached) that no route handled is a 503 with `retry-after` here
(statestore/outages.py), on the hot routes as on the others, authentication included.

Every error body the server writes is rendered here (`send_error`, `error_response`), in the shape of the API whose
route it answers (`shaped_for`: OpenAI's on the Responses and Conversations routes, Anthropic's elsewhere), and every
request body is read under the one limit here (`read_body`), by the front door and by this middleware alike.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from statestore.errors import InternalError, RequestTooLarge, ServiceUnavailable, StatestoreError, StreamBrokenOff
from statestore.logs import new_request_id, request_id_var
from statestore.metrics import OTHER, Metrics
from statestore.outages import refusal_for
from statestore.responses.errors import OPENAI_PATHS, as_openai

RouteResolver = Callable[[Scope], str]

access_logger = logging.getLogger("statestore.access")
logger = logging.getLogger(__name__)

_REQUEST_ID = b"request-id"
# nginx's code for "the client went away before we answered": counted, never sent.
CLIENT_CLOSED_REQUEST = 499


def shaped_for(error: StatestoreError, path: str) -> StatestoreError:
    """The one choice of error shape: the Responses and Conversations doors answer in OpenAI's, the rest in
    Anthropic's."""
    return as_openai(error) if path.startswith(OPENAI_PATHS) else error


def _error_parts(error: StatestoreError, request_id: str) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    body = error.body(request_id)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode("ascii")),
        (_REQUEST_ID, request_id.encode("ascii")),
    ]
    headers.extend((name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in error.headers.items())
    return body, headers


async def send_error(send: Send, error: StatestoreError, scope: Scope) -> None:
    """Send a complete error response for `error`, in the shape of the request's route."""
    error = shaped_for(error, scope.get("path", ""))
    body, headers = _error_parts(error, request_id_of(scope))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def error_response(error: StatestoreError, scope: Scope) -> Response:
    """The same error as a Response, for the router's exception handlers."""
    error = shaped_for(error, scope.get("path", ""))
    body, headers = _error_parts(error, request_id_of(scope))
    response = Response(status_code=error.status)
    response.body = body
    response.raw_headers = headers
    return response


def _too_large(max_bytes: int) -> RequestTooLarge:
    return RequestTooLarge(f"request body exceeds {max_bytes} bytes")


async def read_body(scope: Scope, receive: Receive, max_bytes: int) -> bytes | None:
    """The request's whole body, or None when the client went away before sending it; RequestTooLarge past
    `max_bytes`, declared (answered before a byte is read) or counted as it streams in."""
    declared = _content_length(scope)
    if declared is not None and declared > max_bytes:
        raise _too_large(max_bytes)
    chunks: list[bytes] = []
    received = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        received += len(chunk)
        if received > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def request_id_of(scope: Scope) -> str:
    """The id RequestContextMiddleware gave this request, or a fresh one when it is not installed."""
    state = scope.get("state")
    request_id = state.get("request_id") if isinstance(state, Mapping) else None
    return request_id if isinstance(request_id, str) else new_request_id()


def route_template(scope: Scope) -> str:
    """The template of the route that handled the request (FastAPI leaves the matched route in the scope), or
    "other" for requests no route took. Read after the app ran, so it costs nothing per request."""
    path_format = getattr(scope.get("route"), "path_format", None)
    return path_format if isinstance(path_format, str) else OTHER


def _has_request_id(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    return any(name.lower() == _REQUEST_ID for name, _ in headers)


@dataclass(slots=True)
class _Exchange:
    """What RequestContextMiddleware saw of one request/response pair."""

    status: int | None = None
    bytes_out: int = 0
    finished_at: float | None = None
    client_disconnected: bool = False


class RequestContextMiddleware:
    """Request id, access log line, metrics, and a 500 in the route's error shape for anything unhandled."""

    def __init__(self, app: ASGIApp, metrics: Metrics, route_resolver: RouteResolver | None = None) -> None:
        self.app = app
        self.metrics = metrics
        self.route_resolver = route_resolver if route_resolver is not None else route_template

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        started_at = time.perf_counter()
        request_id = new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id
        token = request_id_var.set(request_id)
        exchange = _Exchange()

        async def watch_receive() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect":
                exchange.client_disconnected = True
            return message

        async def watch_send(message: Message) -> None:
            kind = message["type"]
            if kind == "http.response.start":
                exchange.status = int(message["status"])
                headers = list(message.get("headers", ()))
                # A relayed backend response carries the backend's request id; that one is the useful one.
                if not _has_request_id(headers):
                    headers.append((_REQUEST_ID, request_id.encode("ascii")))
                message = {**message, "headers": headers}
            elif kind == "http.response.body":
                exchange.bytes_out += len(message.get("body", b""))
                if not message.get("more_body", False):
                    exchange.finished_at = time.perf_counter()
            await send(message)

        try:
            await self.app(scope, watch_receive, watch_send)
        except Exception as exc:
            if exchange.status is not None:
                # Too late for an error body: the server aborts the connection and the client sees a cut response.
                if isinstance(exc, StreamBrokenOff):
                    logger.warning("response cut short", extra={"reason": str(exc)})
                else:
                    logger.error("request failed after its response started", exc_info=exc)
                raise
            refusal = refusal_for(exc)
            if refusal is None:
                logger.error("unhandled exception", exc_info=exc)
                error: StatestoreError = InternalError("internal error")
            else:
                if isinstance(refusal, ServiceUnavailable) and refusal is not exc:
                    logger.warning(
                        "store unavailable", extra={"route": self._route(scope), "error": type(exc).__name__}
                    )
                error = refusal
            await send_error(watch_send, error, scope)
        else:
            if exchange.status is None and not exchange.client_disconnected:
                # Otherwise the server would send its own plain-text 500.
                logger.error("the app returned without sending a response")
                await send_error(watch_send, InternalError("internal error"), scope)
        finally:
            self._record(scope, self._route(scope), exchange, started_at)
            request_id_var.reset(token)

    def _route(self, scope: Scope) -> str:
        try:
            return self.route_resolver(scope)
        except Exception:
            # A broken resolver must cost a label, not the request.
            logger.warning("route resolver failed", exc_info=True)
            return OTHER

    def _record(self, scope: Scope, route: str, exchange: _Exchange, started_at: float) -> None:
        ended_at = exchange.finished_at if exchange.finished_at is not None else time.perf_counter()
        duration = ended_at - started_at
        status = exchange.status
        if status is None:
            status = CLIENT_CLOSED_REQUEST if exchange.client_disconnected else InternalError.status
        method = str(scope.get("method", ""))
        self.metrics.observe_request(route, method, status, duration)
        if not access_logger.isEnabledFor(logging.INFO):
            return  # its fields are not built for a line nobody writes (STATESTORE_LOG_LEVEL above INFO)
        client = scope.get("client")
        access_logger.info(
            "request",
            extra={
                "method": method,
                "route": route,
                "status": status,
                "duration_ms": round(duration * 1000, 3),
                "bytes_out": exchange.bytes_out,
                # False for a response cut short (app failure or client gone): its status alone reads as success.
                "complete": exchange.finished_at is not None,
                "client_ip": client[0] if client else None,
            },
        )


class BodySizeLimitMiddleware:
    """413 `request_too_large` for a body over `max_bytes`: the body is read whole under the limit (`read_body`, as
    the front door reads its own), then handed to the app as one message."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            body = await read_body(scope, receive, self.max_bytes)
        except RequestTooLarge as exc:
            await send_error(send, exc, scope)
            return
        if body is None:
            return  # the client went away; nothing will be answered
        pending: Message | None = {"type": "http.request", "body": body, "more_body": False}

        async def replay() -> Message:
            nonlocal pending
            if pending is None:
                return await receive()  # after the body: the disconnect a streamed response watches for
            message, pending = pending, None
            return message

        await self.app(scope, replay, send)


def _content_length(scope: Scope) -> int | None:
    # One dict built in C, not a Python loop over every header (names are lower-case in ASGI; a server refuses a
    # request with two lengths that differ).
    value = dict(scope.get("headers", ())).get(b"content-length")
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        # The server rejects a malformed length itself; counting still guards the body.
        return None
