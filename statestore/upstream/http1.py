"""A lean HTTP/1.1 client for the one model backend: a LIFO pool of keep-alive connections, each request written with
one `writelines`, each response parsed by httptools (llhttp, in C) straight into the relay's hands.

It does what statestore's relays need and nothing else: no redirects, cookies, proxies, content decoding or retries
of a request that may have reached the backend. New connections race the host's addresses (RFC 8305, through
aiohappyeyeballs). A general-purpose client spent about a quarter of a threaded turn's CPU on the layers around those
features (bench/README.md).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections import deque
from typing import cast
from urllib.parse import quote, urlsplit

import aiohappyeyeballs
import httptools

from statestore.retry_policy import STALE_CONNECTION_RETRIES
from statestore.waiters import wake_first

# A relay slower than its backend stops reading the socket past this much unread body, so memory stays bounded.
_HIGH_WATER = 256 * 1024
_LOW_WATER = 64 * 1024
# Requests a backend may safely see twice: retried when a reused connection turns out closed (RFC 9110 §9.2.2), as
# statestore/retry_policy.py says.
_IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})
_NO_BODY_METHODS = frozenset({"GET", "HEAD", "DELETE", "OPTIONS"})
# RFC 8305's recommended wait before the next address is tried alongside the first.
_HAPPY_EYEBALLS_DELAY_S = 0.25
# Characters of a decoded path that stay as they are; everything else is percent-encoded again.
_PATH_SAFE = "/:@!$&'()*+,;=~"


class ConnectionClosed(ConnectionError):
    """The backend closed the connection, or sent what is not HTTP/1.1, before the response ended."""


class PoolExhausted(TimeoutError):
    """Every connection stayed in use for the pool timeout: no connection came free for this request, which was not
    sent."""


class Connection(asyncio.Protocol):
    """One connection and the response being read on it. Its consumer waits on `_waiter`; every parser event wakes
    it."""

    def __init__(self, pool: ConnectionPool) -> None:
        self._pool = pool
        self._loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.busy = False  # a request is out on it and its response not yet given back
        self.used = False  # a response has been read on it before: it may have been closed by the backend while idle
        self.idle_since = 0.0
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._paused = False
        self.counted = True  # in the pool's count of open connections, until discarded
        self._reset_response()

    def _reset_response(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.message_done = False
        self.got_bytes = False
        self._informational = False
        self._keep_alive = False
        self._chunks: deque[bytes] = deque()
        self._buffered = 0

    # -- asyncio.Protocol -----------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        if not self.busy:
            # Bytes nobody asked for (a 408 sent before closing an idle connection): this connection is done.
            self.close()
            return
        self.got_bytes = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ConnectionClosed(f"the backend sent an invalid response ({type(exc).__name__})"))
            self.close()

    def eof_received(self) -> None:
        self.closed = True  # not to be handed out again, even before connection_lost comes

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.headers_done and not self.message_done and self._reads_to_close():
            self.message_done = True  # a body without a length ends with the connection (RFC 9112 §6.3)
            self._wake()
        elif not self.message_done:
            self._fail(ConnectionClosed("the backend closed the connection before the response ended"))
        self._pool.forget(self)

    # -- httptools callbacks --------------------------------------------------------------------------------------

    def _after_the_end(self) -> None:
        # Bytes past the end of the response, before another request was sent: not HTTP. Raising stops the parser
        # here (feed_data raises), so the response already read stays as it was and the connection goes.
        if self.message_done:
            raise ConnectionClosed("the backend sent bytes after its response")

    def on_header(self, name: bytes, value: bytes | None) -> None:
        self._after_the_end()
        self.headers.append((name.lower(), value or b""))

    def on_headers_complete(self) -> None:
        self._after_the_end()
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            # An interim response (100 Continue, 103 Early Hints): the final one follows on the same connection.
            self._informational = True
            self.headers = []
            return
        self.status = status
        self.headers_done = True
        # Asked now: llhttp resets its flags once the message completes.
        self._keep_alive = self._parser.should_keep_alive()
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._after_the_end()
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        self.message_done = True
        self._wake()

    # -- the consumer's side --------------------------------------------------------------------------------------

    def _reads_to_close(self) -> bool:
        return not any(name in (b"content-length", b"transfer-encoding") for name, _ in self.headers)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)

    async def _wait(self) -> None:
        """Until the next event, or TimeoutError when the backend sends nothing for the read timeout."""
        if self._error is not None:
            raise self._error
        waiter = self._waiter = self._loop.create_future()
        timer = self._loop.call_later(self._pool.read_timeout, _expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def send(self, head: bytes, body: bytes) -> None:
        self._reset_response()
        self.busy = True
        assert self.transport is not None
        try:
            # One writev: the body (up to the whole history) is not copied into the head.
            self.transport.writelines((head, body) if body else (head,))
        except RuntimeError as exc:  # the transport closed under us
            raise ConnectionClosed("the connection to the backend was closed") from exc

    async def response_head(self) -> None:
        while not self.headers_done:
            await self._wait()

    def end_head_only(self) -> None:
        """A response to HEAD has no body, whatever its headers say; llhttp cannot be told, so the connection goes."""
        self.message_done = True
        self.close()

    def take(self) -> bytes:
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    async def next_chunk(self) -> bytes | None:
        """The body received since the last call (b"" never), or None at its end."""
        while not self._chunks:
            if self.message_done:
                return None
            await self._wait()
        return self.take()

    @property
    def reusable(self) -> bool:
        # Not when reading was paused and the body left unread: nothing would resume it for the next request.
        return self.message_done and self._keep_alive and not self.closed and self._error is None and not self._paused

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


def _exhausted(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(PoolExhausted())


class ConnectionPool:
    """Connections to one origin, reused last-in first-out (the warmest first), at most `max_connections` open."""

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout: float,
        read_timeout: float,
        max_connections: int,
        keepalive_seconds: float,
        pool_timeout: float = 30.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError("the backend URL must be http:// or https:// with a host")
        self._tls = url.scheme == "https"
        self._host = url.hostname
        self._port = url.port or (443 if self._tls else 80)
        default_port = url.port is None or url.port == (443 if self._tls else 80)
        host = f"[{self._host}]" if ":" in self._host else self._host
        authority = host if default_port else f"{host}:{self._port}"
        self._host_header = authority.encode("ascii" if authority.isascii() else "idna")
        self._prefix = url.path.rstrip("/")
        self._ssl = (ssl_context or ssl.create_default_context()) if self._tls else None
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        # A request waits this long for a connection to come free: a turn waiting holds its lease meanwhile.
        self.pool_timeout = pool_timeout
        self._max = max_connections
        self._keepalive = keepalive_seconds
        self._idle: list[Connection] = []
        self._open = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._sweeper: asyncio.TimerHandle | None = None
        self._closing = False
        self.loop = asyncio.get_running_loop()

    def request_head(self, method: str, path_and_query: str, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
        path, sep, query = path_and_query.partition("?")
        # The query is passed on as the client sent it (scope's raw bytes, read as latin-1).
        target = (self._prefix + quote(path, safe=_PATH_SAFE) + sep + query).encode("latin-1")
        lines: list[bytes] = []
        for name, value in headers:
            lines += (name, b": ", value, b"\r\n")
        relayed = b"".join(lines)
        # Counted over all of them at once: one CR LF a header, no other line break. (`in` on bytes is dearer: it
        # raises and clears a TypeError inside CPython each time.)
        if relayed.count(b"\n") != len(headers) or relayed.count(b"\r") != len(headers):
            raise ValueError("a header to the backend holds a line break")
        length = b"content-length: %d\r\n" % len(body) if body or method not in _NO_BODY_METHODS else b""
        start = b"%s %s HTTP/1.1\r\nhost: %s\r\n" % (method.encode("ascii"), target, self._host_header)
        return b"".join((start, relayed, length, b"\r\n"))

    async def exchange(self, method: str, head: bytes, body: bytes) -> Connection:
        """Send one request and return its connection once the response's head has arrived. Raises OSError
        (ConnectionClosed included) or TimeoutError; the connection is then closed."""
        retries = STALE_CONNECTION_RETRIES if method in _IDEMPOTENT else 0
        while True:
            connection = await self.acquire()
            try:
                connection.send(head, body)
                await connection.response_head()
            except BaseException as exc:
                reused = connection.used
                self.release(connection, reuse=False)
                if retries and reused and isinstance(exc, ConnectionClosed) and not connection.got_bytes:
                    retries -= 1  # the backend had closed the idle connection: nothing of this request was read
                    continue
                raise
            if method == "HEAD":
                connection.end_head_only()
            return connection

    async def acquire(self) -> Connection:
        while True:
            if self._closing:
                raise ConnectionClosed("the backend client is closed")
            now = self.loop.time()
            while self._idle:
                connection = self._idle.pop()
                if not connection.closed and now - connection.idle_since < self._keepalive:
                    return connection
                self._discard(connection)
            if self._open < self._max:
                return await self._connect()
            waiter = self.loop.create_future()
            self._waiters.append(waiter)
            timer = self.loop.call_later(self.pool_timeout, _exhausted, waiter)
            try:
                await waiter
            except PoolExhausted:
                # Timed out while still in line (a wake would have settled the future first): leave the line.
                self._waiters.remove(waiter)
                raise
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._wake_one()  # woken and cancelled at once: the freed connection goes to the next in line
                raise
            finally:
                timer.cancel()

    async def _connect(self) -> Connection:
        self._open += 1
        try:
            async with asyncio.timeout(self.connect_timeout):
                addresses = await self.loop.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM)
                # The addresses raced as RFC 8305 says (uvloop cannot): a host whose IPv6 route silently drops packets
                # still connects over IPv4 within the connect timeout, instead of spending it all on the first address.
                sock = await aiohappyeyeballs.start_connection(
                    addresses, happy_eyeballs_delay=_HAPPY_EYEBALLS_DELAY_S, interleave=1, loop=self.loop
                )
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    _, connection = await self.loop.create_connection(
                        lambda: Connection(self),
                        sock=sock,
                        ssl=self._ssl,
                        server_hostname=self._host if self._tls else None,
                    )
                except BaseException:
                    sock.close()
                    raise
        except BaseException:
            self._open -= 1
            self._wake_one()
            raise
        return connection

    def release(self, connection: Connection, *, reuse: bool) -> None:
        """Give a connection back: kept when its response was read to the end, closed otherwise."""
        connection.busy = False
        if reuse and connection.reusable and not self._closing:
            connection.used = True
            connection.idle_since = self.loop.time()
            self._idle.append(connection)
            if self._sweeper is None:
                self._sweeper = self.loop.call_later(self._keepalive, self._sweep)
            self._wake_one()
            return
        self._discard(connection)

    def forget(self, connection: Connection) -> None:
        """A connection the backend closed while it sat idle leaves the pool now, not at its next checkout."""
        if connection in self._idle:
            self._idle.remove(connection)
            self._discard(connection)

    def _discard(self, connection: Connection) -> None:
        if connection.counted:
            connection.counted = False
            self._open -= 1
        connection.close()
        self._wake_one()

    def _sweep(self) -> None:
        self._sweeper = None
        cutoff = self.loop.time() - self._keepalive
        for connection in [c for c in self._idle if c.idle_since <= cutoff]:
            self._idle.remove(connection)
            self._discard(connection)
        if self._idle:
            self._sweeper = self.loop.call_later(self._keepalive, self._sweep)

    def _wake_one(self) -> None:
        wake_first(self._waiters)

    async def aclose(self) -> None:
        self._closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        idle, self._idle = self._idle, []
        for connection in idle:
            self._discard(connection)
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
