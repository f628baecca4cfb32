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

Text messages the app takes as they arrive: the same extension's `listen` registers a taker (payload: bytes) -> bool
that each whole text message is offered first, when nothing received before it waits in uvicorn's queue; a message it
takes (True) is the app's at once, without a `websocket.receive` event (its queue, a wake of the task reading, and
reading paused and resumed: two system calls); one it leaves (False) is queued as uvicorn queues any.

Reads, once a taker listens on an uncompressed connection whose handshake came alone: the protocol splits what
arrives into frames itself (RFC 6455 5.2), and a whole masked text frame of up to 64 KiB, none of a fragmented message
open, is unmasked here and offered to the taker; every other frame (control frames, fragments, binary, larger ones,
any the taker leaves, anything malformed) goes to websockets whole, which does with it all it ever did. websockets'
parser (a generator through a stream reader, a Frame, uvicorn's dispatch) was most of what a message cost to read.

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
from websockets.frames import Frame
from websockets.protocol import State

# The scope's extension: {"write": (payload: bytes) -> bool, "listen": (taker: ((bytes) -> bool) | None) -> None}
TEXT_WRITER = "statestore.websocket.text"
# What drains the app's WebSockets, registered by the app (one per app in this process); each returns whether it
# will close its connections itself.
DRAINS: list[Callable[[], bool]] = []


_TEXT = 0x81  # FIN and the text opcode: a whole message in one frame
_BINARY = 0x82
_SHORT_TEXT = tuple(bytes((_TEXT, length)) for length in range(126))  # the header of each text shorter than 126
_MEDIUM = struct.Struct("!BBH").pack  # a header with a 16-bit length
_MASKED = 0x80
_FIN = 0x80
_OPCODE_CONTINUATION, _OPCODE_TEXT, _OPCODE_BINARY = 0, 1, 2
_TAKEN_AT_MOST = 65536  # larger text frames are unmasked by websockets (in C), not by a big-integer XOR here
_END_OF_REQUEST = b"\r\n\r\n"


def _header(first: int, length: int) -> bytes:
    """A server frame's header (RFC 6455 5.2: unmasked, no extension bits)."""
    if length < 126:
        return struct.pack("!BB", first, length)
    if length < 65536:
        return _MEDIUM(first, 126, length)
    return struct.pack("!BBQ", first, 127, length)


def _unmask(mask: bytes, payload: bytes) -> bytes:
    """A client frame's payload XORed with its 4-byte mask (RFC 6455 5.3), as two integers."""
    length = len(payload)
    key = (mask * ((length >> 2) + 1))[:length]
    return (int.from_bytes(payload, "little") ^ int.from_bytes(key, "little")).to_bytes(length, "little")


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
        self._taker: Callable[[bytes], bool] | None = None  # the app's, offered each whole text message first
        # The handshake's request came in a read of its own, nothing after it: websockets holds no bytes yet.
        self._alone = False
        self._framing = False  # received frames are split here (data_received), not by websockets
        self._partial = b""  # the start of a frame not yet whole
        self._fragmented = False  # websockets has the first frames of a message, not yet its last
        self._through = 0  # bytes still to come of a frame websockets is given as they arrive
        self._taken_at_most = min(_TAKEN_AT_MOST, self.config.ws_max_size)

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        # The app's task is created but has not run: the scope it will read still takes an extension.
        scope: Any = getattr(self, "scope", None)
        if scope is not None:
            scope["extensions"][TEXT_WRITER] = {"write": self.write_text, "listen": self.listen}

    def listen(self, taker: Callable[[bytes], bool] | None) -> None:
        self._taker = taker
        if taker is not None and self._alone and self._plain and not self.close_sent:
            self._framing = True

    def handle_text(self, event: Frame) -> None:
        taker = self._taker
        # A whole message (a first frame that is also the last), nothing before it waiting: the taker may have it,
        # unless it was offered it already (`_split` gives websockets only frames the taker could not have).
        if (
            taker is None
            or self._framing
            or not event.fin
            or self.close_sent
            or not self.queue.empty()
            or not taker(bytes(event.data))
        ):
            super().handle_text(event)

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
        payload = data if data is not None else (message.get("text") or "").encode()
        if self._direct:
            # The frame as websockets would serialize it, without its copies through a Frame and a buffer.
            self._unsent += (_header(_BINARY if data is not None else _TEXT, len(payload)), payload)
        else:  # compressed (permessage-deflate), or closing: websockets frames it, or says why not
            conn = self.conn
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
        if self._framing:
            self._frames_received(data)
        else:
            shaking = not self.handshake_initiated
            self._alone = False
            self._pass(data)
            if shaking and self.handshake_initiated:
                self._alone = data.endswith(_END_OF_REQUEST) and data.count(_END_OF_REQUEST) == 1

    def _pass(self, data: bytes) -> None:
        """Bytes for websockets, and uvicorn's handling of what it makes of them."""
        super().data_received(data)
        self._recheck()  # a close from the client, or a frame websockets refused

    def _frames_received(self, data: bytes) -> None:
        if self._through:  # the rest of a frame too large to take, websockets' as it comes
            passed = data[: self._through]
            self._through -= len(passed)
            self._pass(passed)
            if self._closing(data, len(passed)) or len(passed) == len(data):
                return
            data = data[len(passed) :]
        self._split(self._partial + data if self._partial else data)

    def _split(self, data: bytes) -> None:
        """Received bytes, cut into whole frames: a whole text message the taker takes is the app's, any other frame is
        websockets'; a frame not yet whole waits for the next read."""
        start, size = 0, len(data)
        while size - start >= 2:
            first, second = data[start], data[start + 1]
            length, at = second & 0x7F, start + 2
            if length == 126:
                length, at = int.from_bytes(data[at : at + 2], "big"), at + 2
            elif length == 127:
                length, at = int.from_bytes(data[at : at + 8], "big"), at + 8
            if second & _MASKED:
                at += 4
            if at > size:
                break  # a header not yet whole
            end = at + length
            if length > self._taken_at_most:
                # Never taken: websockets has it as it comes (and fails it at once when over the limit).
                self._frame_passed(first)
                self._through = max(0, end - size)
                self._pass(data[start:end])
                start = min(end, size)
                if self._closing(data, start):
                    return
                continue
            if end > size:
                break
            taker = self._taker
            if (
                first == _TEXT
                and second & _MASKED
                and length <= self._taken_at_most
                and taker is not None
                and not self.close_sent
                and not self._fragmented
                and self.queue.empty()
                and taker(_unmask(data[at - 4 : at], data[at:end]))
            ):
                start = end
                continue
            self._frame_passed(first)
            self._pass(data[start:end])
            start = end
            if self._closing(data, start):
                return
        self._partial = data[start:]

    def _frame_passed(self, first: int) -> None:
        """Whether a message is left open, by the first byte of a frame given to websockets."""
        opcode = first & 0x0F
        if opcode in (_OPCODE_TEXT, _OPCODE_BINARY):
            self._fragmented = not first & _FIN
        elif opcode == _OPCODE_CONTINUATION and first & _FIN:
            self._fragmented = False

    def _closing(self, data: bytes, start: int) -> bool:
        """websockets failed the connection, or the client closed it: the bytes left are websockets', as all after."""
        if not self.transport.is_closing():
            return False
        self._framing = False
        self._partial = b""
        self._through = 0
        if start < len(data):
            self._pass(data[start:])
        return True

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
