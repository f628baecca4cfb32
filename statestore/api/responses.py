"""Responses with header lists we build ourselves (the backend's headers, in order, plus ours), and the streamed relay
of a reply."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send


class BytesReply(Response):
    """A whole body with the headers we built. Response.__init__ would render an empty body and build a header list
    that this one replaces: on every JSON turn."""

    def __init__(self, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        self.status_code = status
        self.body = body
        self.raw_headers = [*headers, (b"content-length", b"%d" % len(body))]
        self.background = None


def bytes_response(status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> Response:
    return BytesReply(status, body, headers)


class StreamedReply(Response):
    """A body relayed chunk by chunk as it is made, whose clean-up runs however the response ends.

    A client that goes away cancels the relay (its shielded steps, a commit, still finish), like Starlette's
    StreamingResponse, but watched by one plain task instead of an anyio task group: the server declares ASGI 2.3, so
    a disconnect shows only on `receive`, and the task group cost a streamed turn more than its commit's round trip in
    CPU (bench/README.md). A client that goes away before the first chunk leaves the body iterator never started, and
    then its own `finally` never runs: `on_close` does.
    """

    def __init__(
        self,
        chunks: AsyncIterator[bytes],
        status: int,
        headers: list[tuple[bytes, bytes]],
        on_close: Callable[[], Awaitable[None]],
    ) -> None:
        # Response.__init__ would render a body and build headers this class never uses.
        self.status_code = status
        self.raw_headers = headers
        self.background = None
        self._chunks = chunks
        self._on_close = on_close

    def captured(self, ended: Callable[[list[bytes] | None], Awaitable[None]]) -> StreamedReply:
        """This reply with every chunk kept as it passes: once it closes, `ended` gets them all if the body ran to
        its end, None if it broke off (a client gone, a backend cut). For an Idempotency-Key's replay."""
        chunks, on_close = self._chunks, self._on_close
        kept: list[bytes] = []
        whole = False

        async def keeping() -> AsyncIterator[bytes]:
            nonlocal whole
            try:
                async for chunk in chunks:
                    kept.append(chunk)
                    yield chunk
                whole = True
            finally:
                aclose = getattr(chunks, "aclose", None)
                if aclose is not None:
                    await aclose()

        async def close() -> None:
            try:
                await on_close()
            finally:
                await ended(kept if whole else None)

        return StreamedReply(keeping(), self.status_code, self.raw_headers, close)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        relay = anyio.CancelScope()
        watcher = asyncio.get_running_loop().create_task(_cancel_on_disconnect(receive, relay))
        try:
            with relay:
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                async for chunk in self._chunks:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            with anyio.CancelScope(shield=True):
                aclose = getattr(self._chunks, "aclose", None)
                if aclose is not None:
                    await aclose()  # a generator left suspended (a send that failed) runs its clean-up now, not at GC
                await self._on_close()
        if self.background is not None:
            await self.background()


async def _cancel_on_disconnect(receive: Receive, relay: anyio.CancelScope) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            relay.cancel()
            return


def streaming_response(
    status: int,
    chunks: AsyncIterator[bytes],
    headers: list[tuple[bytes, bytes]],
    *,
    on_close: Callable[[], Awaitable[None]],
) -> Response:
    return StreamedReply(chunks, status, list(headers), on_close)
