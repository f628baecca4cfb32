"""Starlette responses with header lists we build ourselves (the backend's headers, in order, plus ours)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.responses import Response, StreamingResponse


def bytes_response(status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> Response:
    response = Response(status_code=status)
    response.body = body
    response.raw_headers = [*headers, (b"content-length", str(len(body)).encode())]
    return response


def streaming_response(status: int, chunks: AsyncIterator[bytes], headers: list[tuple[bytes, bytes]]) -> Response:
    response = StreamingResponse(chunks, status_code=status)
    response.raw_headers = list(headers)
    return response
