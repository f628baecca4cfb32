"""Responses with header lists we build ourselves (the backend's headers, in order, plus ours), and the streamed relay
of a reply."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send


def bytes_response(status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> Response:
    response = Response(status_code=status)
    response.body = body
    response.raw_headers = [*headers, (b"content-length", str(len(body)).encode())]
    return response


class StreamedReply(Response):
    """A body relayed chunk by chunk as it is made, whose clean-up runs however the response ends.

    The relay is never cancelled. A client that goes away makes `on_disconnect` close the backend's response, so the
    relay stops at its next read of the backend, and whatever step it is in (a commit) runs to its end: nothing is
    left half done, and no shield is needed around it. Starlette's StreamingResponse instead watches with an anyio
    task group and cancels (the server declares ASGI 2.3, so a disconnect shows only on `receive`); the group and
    the shields its cancellation called for cost a streamed turn more CPU than its commit's round trip did
    (bench/README.md). A client that goes away before the first chunk leaves the body iterator never started, and
    then its own `finally` never runs: `on_close` does.
    """

    def __init__(
        self,
        chunks: AsyncIterator[bytes],
        status: int,
        headers: list[tuple[bytes, bytes]],
        on_close: Callable[[], Awaitable[None]],
        on_disconnect: Callable[[], Awaitable[None]] | None,
    ) -> None:
        # Response.__init__ would render a body and build headers this class never uses.
        self.status_code = status
        self.raw_headers = headers
        self.background = None
        self._chunks = chunks
        self._on_close = on_close
        self._on_disconnect = on_disconnect
        self._client_left = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.get_running_loop().create_task(self._watch(receive))
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self._chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except Exception:
            if not self._client_left:
                raise
            # The backend's response was closed under the relay because the client left: nobody to tell.
        finally:
            watcher.cancel()
            aclose = getattr(self._chunks, "aclose", None)
            if aclose is not None:
                await aclose()  # a generator left suspended (a send that failed) runs its clean-up now, not at GC
            await self._on_close()
        if self.background is not None:
            await self.background()

    async def _watch(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self._client_left = True
                if self._on_disconnect is not None:
                    await self._on_disconnect()
                return


def streaming_response(
    status: int,
    chunks: AsyncIterator[bytes],
    headers: list[tuple[bytes, bytes]],
    *,
    on_close: Callable[[], Awaitable[None]],
    on_disconnect: Callable[[], Awaitable[None]] | None = None,
) -> Response:
    """`on_disconnect`: what makes the relay stop when the client leaves (closing the backend's response it reads)."""
    return StreamedReply(chunks, status, list(headers), on_close, on_disconnect)
