"""Starlette responses with header lists we build ourselves (the backend's headers, in order, plus ours)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send


def bytes_response(status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> Response:
    response = Response(status_code=status)
    response.body = body
    response.raw_headers = [*headers, (b"content-length", str(len(body)).encode())]
    return response


class _Stream(StreamingResponse):
    """A stream whose clean-up runs however the response ends: a client that goes away before the first chunk can
    leave the body iterator never started, and then its own `finally` never runs."""

    def __init__(self, chunks: AsyncIterator[bytes], status: int, on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(chunks, status_code=status)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_close()


def streaming_response(
    status: int,
    chunks: AsyncIterator[bytes],
    headers: list[tuple[bytes, bytes]],
    *,
    on_close: Callable[[], Awaitable[None]],
) -> Response:
    response = _Stream(chunks, status, on_close)
    response.raw_headers = list(headers)
    return response
