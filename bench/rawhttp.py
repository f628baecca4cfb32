"""The load generator's clients: HTTP/1.1 keep-alive on raw asyncio protocols, and a few Redis commands.

On a 2-core machine the client shares the CPU with everything it measures, so it does the least work it can:
requests are pre-rendered bytes written in one call, responses are parsed by httptools (C, llhttp), and of a body
only the first and last few hundred bytes are kept (enough for the message id and the final SSE event).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, cast

import httptools

_KEEP_HEAD = 512
_KEEP_TAIL = 64
THREAD_HEADER = b"statestore-thread-id"


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    sent_ns: int  # perf_counter_ns when the request was written
    first_byte_ns: int  # first byte of the body (of the head when there is no body)
    done_ns: int  # end of the response
    head: bytes  # the body's first bytes
    tail: bytes  # the body's last bytes
    body_bytes: int
    thread_id: str | None

    @property
    def ttfb_ms(self) -> float:
        return (self.first_byte_ns - self.sent_ns) / 1e6

    @property
    def total_ms(self) -> float:
        return (self.done_ns - self.sent_ns) / 1e6

    def message_id(self) -> str | None:
        """The reply's Message id: the first `"id"` of a JSON Message or of a stream's message_start."""
        at = self.head.find(b'"id":"')
        if at < 0:
            return None
        end = self.head.find(b'"', at + 6)
        return self.head[at + 6 : end].decode() if end > 0 else None

    def complete_stream(self) -> bool:
        return b"event: message_stop" in self.tail


class ConnectionClosed(Exception):
    pass


class HttpConnection(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._parser: Any = None
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self._sent_ns = 0
        self._first_ns = 0
        self._headers_ns = 0
        self._done_ns = 0
        self._status = 0
        self._head = bytearray()
        self._tail = b""
        self._bytes = 0
        self._thread_id: str | None = None

    @classmethod
    async def open(cls, host: str, port: int) -> HttpConnection:
        loop = asyncio.get_running_loop()
        _, protocol = await loop.create_connection(cls, host, port)
        return protocol

    # -- asyncio.Protocol --------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not subclasses of asyncio.Transport, only alike.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ConnectionClosed(f"bad response: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(ConnectionClosed("connection closed by the server"))

    def _fail(self, exc: Exception) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)

    # -- httptools callbacks -----------------------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) == len(THREAD_HEADER) and name.lower() == THREAD_HEADER:
            self._thread_id = value.decode()

    def on_headers_complete(self) -> None:
        self._headers_ns = time.perf_counter_ns()
        self._status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if not self._first_ns:
            self._first_ns = time.perf_counter_ns()
        self._bytes += len(body)
        if len(self._head) < _KEEP_HEAD:
            self._head += body[: _KEEP_HEAD - len(self._head)]
        self._tail = (self._tail + body[-_KEEP_TAIL:])[-_KEEP_TAIL:]

    def on_message_complete(self) -> None:
        self._done_ns = time.perf_counter_ns()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # -- use -----------------------------------------------------------------------------------------------------

    async def request(self, raw: bytes) -> Reply:
        if self.closed or self._transport is None:
            raise ConnectionClosed("connection is closed")
        self._reset()
        self._parser = httptools.HttpResponseParser(self)
        self._waiter = asyncio.get_running_loop().create_future()
        self._sent_ns = time.perf_counter_ns()
        self._transport.write(raw)
        await self._waiter
        return Reply(
            status=self._status,
            sent_ns=self._sent_ns,
            first_byte_ns=self._first_ns or self._headers_ns,
            done_ns=self._done_ns,
            head=bytes(self._head),
            tail=self._tail,
            body_bytes=self._bytes,
            thread_id=self._thread_id,
        )

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


def render_request(host: str, port: int, path: str, headers: list[tuple[str, str]], body: bytes) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"host: {host}:{port}"]
    lines += [f"{name}: {value}" for name, value in headers]
    lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class RedisConnection:
    """Just enough RESP for DEL and EXISTS (integer replies)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, host: str, port: int) -> RedisConnection:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer)

    async def integer(self, *args: bytes) -> int:
        out = [b"*%d\r\n" % len(args)]
        for arg in args:
            out.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
        self._writer.write(b"".join(out))
        line = await self._reader.readline()
        if not line.startswith(b":"):
            raise RuntimeError(f"unexpected Redis reply {line[:80]!r}")
        return int(line[1:])

    async def aclose(self) -> None:
        self._writer.close()
        await self._writer.wait_closed()
