"""The WebSocket protocol statestore serves with (WebSocket mode on /v1/responses, api/responses_socket.py):
uvicorn's websockets-sansio protocol, with two differences.

Writes: each message is still a frame of its own, but the frames an app sends without waiting in between (a turn's
events that one backend chunk produced, the closing events) leave in one write to the socket, at the end of the event
loop's pass, instead of a write each: a write is a system call, and on a turn of ten small events the writes were
most of what the socket path cost beyond the turn itself. Nothing waits for more: the write happens as soon as the
app next waits, so no event is later than it was.

Text messages the app has as UTF-8 already: the scope's extension `statestore.websocket.text` holds `write`, which
frames such a message and queues it for that same write at once, without a `websocket.send` event (its dict, a
decode to `str` and an encode back, a coroutine); it returns False, queuing nothing, whenever a frame cannot be
written that way now (compressed, closing, the transport's buffer full, the client gone), and the app then sends the
message through ASGI, which waits or says why.

Shutdown: uvicorn closes every open WebSocket at once with 1012; here the app is asked to drain instead: a connection
takes no new response, its running one finishes within the background grace, then it closes with 1001 (going away),
and uvicorn waits for that as it waits for any request."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.utils import ClientDisconnected
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import InvalidState
from websockets.protocol import State

TEXT_WRITER = "statestore.websocket.text"  # the scope's extension: {"write": (payload: bytes) -> bool}
# What drains the app's WebSockets, registered by the app (one per app in this process); each returns whether it
# will close its connections itself.
DRAINS: list[Callable[[], bool]] = []


_TEXT = 0x81  # FIN and the text opcode: a whole message in one frame
_BINARY = 0x82
_SHORT_TEXT = tuple(bytes((_TEXT, length)) for length in range(126))  # the header of each text shorter than 126
_MEDIUM = struct.Struct("!BBH").pack  # a header with a 16-bit length


def _header(first: int, length: int) -> bytes:
    """A server frame's header (RFC 6455 5.2: unmasked, no extension bits)."""
    if length < 126:
        return struct.pack("!BB", first, length)
    if length < 65536:
        return _MEDIUM(first, 126, length)
    return struct.pack("!BBQ", first, 127, length)


def drain() -> bool:
    drains = [each() for each in list(DRAINS)]
    return any(drains)


class StatestoreWebSocketProtocol(WebSocketsSansIOProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._unsent: list[bytes] = []  # frames sent by the app, not yet written
        self._flushing: asyncio.Handle | None = None
        self._plain = False  # accepted, uncompressed: `write_text` may frame messages itself
        # ... and right now: open, not closing, the client there, the transport's buffer not full. Kept up to date
        # where any of these changes (the methods below), so that a message written asks one question.
        self._direct = False

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        # The app's task is created but has not run: the scope it will read still takes an extension.
        scope: Any = getattr(self, "scope", None)
        if scope is not None:
            scope["extensions"][TEXT_WRITER] = {"write": self.write_text}

    def write_text(self, payload: bytes) -> bool:
        """A whole text message, `payload` its UTF-8, framed and queued for the next write; False (nothing queued)
        when it must go through `send` instead."""
        # No fragmented message is ever open here: uvicorn sends each message whole.
        if not self._direct:
            return False
        length = len(payload)
        if length < 126:
            self._unsent += (_SHORT_TEXT[length], payload)
        elif length < 65536:
            self._unsent += (_MEDIUM(_TEXT, 126, length), payload)
        else:
            self._unsent += (_header(_TEXT, length), payload)
        if self._flushing is None:
            self._flushing = self.loop.call_soon(self.flush)
        return True

    async def send(self, message: Any) -> None:  # an ASGI send event, as uvicorn's own method takes
        if message["type"] != "websocket.send" or not self.handshake_complete or self.close_sent:
            self.flush()  # whatever uvicorn writes next goes after the frames before it
            try:
                await super().send(message)
            finally:
                if message["type"] == "websocket.accept":
                    self._plain = self.handshake_complete and self.initial_response is None and not self.conn.extensions
                self._recheck()
            return
        if self.initial_response is not None:
            await super().send(message)  # refused: uvicorn says what is wrong
            return
        await self.writable.wait()
        if self.disconnected:
            raise ClientDisconnected
        data = message.get("bytes")
        first = _BINARY if data is not None else _TEXT
        payload = data if data is not None else (message.get("text") or "").encode()
        conn = self.conn
        if not conn.extensions and conn.state is State.OPEN and not conn.expect_continuation_frame:
            # The frame as websockets would serialize it, without its copies through a Frame and a buffer.
            self._unsent += (_header(first, len(payload)), payload)
        else:  # compressed (permessage-deflate), or closing: websockets frames it, or says why not
            try:
                if data is not None:
                    conn.send_binary(payload)
                else:
                    conn.send_text(payload)
            except InvalidState:
                raise ClientDisconnected from None
            self._unsent += conn.data_to_send()
        if self._flushing is None:
            self._flushing = self.loop.call_soon(self.flush)

    def _recheck(self) -> None:
        self._direct = (
            self._plain
            and not self.close_sent
            and not self.disconnected
            and self.writable.is_set()
            and self.conn.state is State.OPEN
        )

    def pause_writing(self) -> None:
        super().pause_writing()
        self._direct = False

    def resume_writing(self) -> None:
        super().resume_writing()
        self._recheck()

    def flush(self) -> None:
        """Write the frames the app sent since the last write, in one write."""
        if self._flushing is not None:
            self._flushing.cancel()
            self._flushing = None
        if self._unsent:
            unsent, self._unsent = self._unsent, []
            if not self.transport.is_closing():
                self.transport.write(b"".join(unsent))

    # uvicorn's own writes (a pong, a close, a ping) go after the app's frames.
    def data_received(self, data: bytes) -> None:
        self.flush()
        super().data_received(data)
        self._recheck()  # a close from the client, or a frame websockets refused

    def send_keepalive_ping(self) -> None:
        self.flush()
        super().send_keepalive_ping()

    def keepalive_timeout(self) -> None:
        self.flush()
        super().keepalive_timeout()
        self._recheck()

    def connection_lost(self, exc: Exception | None) -> None:
        self._direct = False
        if self._flushing is not None:
            self._flushing.cancel()
            self._flushing = None
        self._unsent = []
        super().connection_lost(exc)

    def shutdown(self) -> None:
        self.flush()
        if self.handshake_complete and not self.close_sent and drain():
            return  # the app closes this connection (with 1001) once its running response is done
        super().shutdown()
        self._recheck()
