"""Stateless relay: the request goes to the backend as it came, and the response comes back byte for byte, streamed
as it arrives (docs/protocol.md §1)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import anyio
from starlette.responses import Response

from statestore.api.responses import streaming_response
from statestore.errors import StreamBrokenOff
from statestore.upstream.client import (
    StreamInterrupted,
    Upstream,
    UpstreamResponse,
    request_headers_for_upstream,
    response_headers_for_client,
)

log = logging.getLogger(__name__)


async def relay(
    upstream: Upstream,
    method: str,
    path_and_query: str,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    *,
    credential: tuple[bytes, bytes] | None,
) -> Response:
    response = await upstream.send(
        method, path_and_query, request_headers_for_upstream(headers, threaded=False, credential=credential), body
    )
    return streaming_response(
        response.status,
        _passthrough(response),
        response_headers_for_client(response.headers, keep_length=True),
        on_close=response.aclose,
    )


async def _passthrough(response: UpstreamResponse) -> AsyncIterator[bytes]:
    try:
        async for chunk in response.chunks():
            yield chunk
    except StreamInterrupted as exc:
        # The status line has gone out already: cutting the connection is how the client learns of it.
        raise StreamBrokenOff(f"the backend response broke off ({type(exc).__name__})") from exc
    finally:
        with anyio.CancelScope(shield=True):
            await response.aclose()
