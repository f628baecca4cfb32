"""The echo backend's ASGI plumbing: reading a body, JSON, SSE and error responses in the API's shapes, and serving an
ASGI app on uvicorn (used by the echo backend, the fake backend of the tests and the bench)."""

from __future__ import annotations

import socket
from collections.abc import Iterable
from typing import Any

import orjson
import uvicorn
from starlette.types import ASGIApp, Receive, Send

from statestore.upstream import wire

# The real API's limit for a Messages request body.
MAX_BODY_BYTES = 32 * 1024 * 1024


async def read_body(receive: Receive, limit: int = MAX_BODY_BYTES) -> bytes | None:
    """The whole request body, or None when it exceeds `limit` (or the client left)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        event = await receive()
        if event["type"] != "http.request":
            return None
        chunk: bytes = event.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not event.get("more_body", False):
            return b"".join(chunks)


def _headers(
    content_type: bytes, request_id: str, extra: Iterable[tuple[bytes, bytes]] = ()
) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", content_type), (b"request-id", request_id.encode()), *extra]


async def send_json(
    send: Send, status: int, body: bytes, request_id: str, extra_headers: Iterable[tuple[bytes, bytes]] = ()
) -> None:
    length = [(b"content-length", str(len(body)).encode())]
    headers = _headers(wire.JSON_CONTENT_TYPE, request_id, [*length, *extra_headers])
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(send: Send, error_type: str, message: str, request_id: str) -> None:
    status = wire.ERROR_STATUS.get(error_type, 500)
    await send_json(send, status, wire.error_body(error_type, message, request_id), request_id)


async def send_sse_start(send: Send, request_id: str) -> None:
    headers = _headers(wire.SSE_CONTENT_TYPE, request_id, [(b"cache-control", b"no-cache")])
    await send({"type": "http.response.start", "status": 200, "headers": headers})


async def parse_request(receive: Receive, send: Send, request_id: str) -> dict[str, Any] | None:
    """The JSON object body of a POST, or None after answering the client with the API's 4xx."""
    body = await read_body(receive)
    if body is None:
        await send_error(send, "request_too_large", "Request exceeds the maximum allowed size", request_id)
        return None
    try:
        request = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        await send_error(send, "invalid_request_error", f"Request body is not valid JSON: {exc}", request_id)
        return None
    if not isinstance(request, dict):
        await send_error(send, "invalid_request_error", "Request body must be a JSON object", request_id)
        return None
    return request


async def lifespan(receive: Receive, send: Send) -> None:
    while True:
        event = await receive()
        if event["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif event["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def serve_asgi(
    app: ASGIApp,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    sock: socket.socket | None = None,
    log_level: str = "warning",
) -> None:
    """Serve `app` with uvicorn until interrupted, on `sock` when given (already bound), else on host:port."""
    # "auto" picks uvloop and httptools when they are installed, the pure-Python ones otherwise.
    config = uvicorn.Config(
        app, host=host, port=port, loop="auto", http="auto", lifespan="off", log_level=log_level, access_log=False
    )
    uvicorn.Server(config).run(sockets=[sock] if sock is not None else None)
