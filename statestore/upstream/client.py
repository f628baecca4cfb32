"""The one pooled HTTP client to the model backend, created in the app's lifespan.

Relays keep the backend's status, headers and body bytes; only hop-by-hop headers and those statestore owns are
dropped on the way in and out (docs/protocol.md §1).
"""

from __future__ import annotations

import ssl
import time
from collections.abc import AsyncIterator, Iterable
from typing import Literal, Protocol

from statestore.errors import UpstreamBusy, UpstreamTimeout, UpstreamUnreachable
from statestore.metrics import Metrics, upstream_outcome
from statestore.upstream.http1 import Connection, ConnectionPool, PoolExhausted

THREADS_BETA = "message-threads-2026-08-12"

# RFC 9110 §7.6.1 plus the ones proxies conventionally treat as per-hop.
_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
# Recomputed by whoever writes the body next. `expect: 100-continue` asked statestore's server for leave to send the
# body; it has been read whole, so the backend gets it without asking.
_BODY_FRAMING = frozenset({b"content-length", b"host", b"expect"})
_CREDENTIALS = frozenset({b"x-api-key", b"authorization"})
# The server adds its own.
_SERVER_OWNED = frozenset({b"date"})
_NOT_RELAYED = _HOP_BY_HOP | _SERVER_OWNED
_THREADS_BETA = THREADS_BETA.encode()
# A threaded turn's key is statestore's to answer (docs/protocol.md §11): the backend is sent requests the client never
# sent under it (the rebuilt turn, a summary, a cut retry after a refusal), and a backend that honours keys would
# answer one of them with another's outcome or refuse it as the key reused. A relay's request is the client's own.
_IDEMPOTENCY_KEY = b"idempotency-key"
_THREADED_OWN = frozenset({b"accept-encoding", _IDEMPOTENCY_KEY})
# Every name request_headers_for_upstream does more with than pass on.
_LOOKED_AT = _HOP_BY_HOP | _BODY_FRAMING | _CREDENTIALS | _THREADED_OWN | {b"anthropic-beta"}


def request_headers_for_upstream(
    headers: Iterable[tuple[bytes, bytes]], *, threaded: bool, credential: tuple[bytes, bytes] | None = None
) -> list[tuple[bytes, bytes]]:
    """The client's headers as the backend should see them: credentials and `anthropic-*` kept, hop-by-hop headers,
    `statestore-*` and the threads beta removed. A threaded turn asks for an uncompressed reply because statestore
    reads it, and keeps its `Idempotency-Key` to itself. With a `credential` (keys mode) the client's credential
    headers are replaced by it."""
    out: list[tuple[bytes, bytes]] = []
    for raw_name, value in headers:
        name = raw_name.lower()
        if name not in _LOOKED_AT:  # most headers (the SDKs send a dozen x-stainless-*): one set test
            if not name.startswith(b"statestore-"):
                out.append((name, value))
            continue
        if name in _HOP_BY_HOP or name in _BODY_FRAMING:
            continue
        if credential is not None and name in _CREDENTIALS:
            continue
        if name == b"anthropic-beta":
            if value == _THREADS_BETA:
                continue
            betas = [b.strip() for b in value.split(b",") if b.strip() and b.strip() != _THREADS_BETA]
            if betas:
                out.append((name, b",".join(betas)))
            continue
        if threaded and name in _THREADED_OWN:
            continue
        out.append((name, value))
    if threaded:
        out.append((b"accept-encoding", b"identity"))
    if credential is not None:
        out.append(credential)
    return out


def response_headers_for_client(
    headers: Iterable[tuple[bytes, bytes]], *, keep_length: bool
) -> list[tuple[bytes, bytes]]:
    out: list[tuple[bytes, bytes]] = []
    for raw_name, value in headers:
        name = raw_name.lower()
        if name in _NOT_RELAYED or (name == b"content-length" and not keep_length):
            continue
        out.append((name, value))
    return out


class StreamInterrupted(Exception):
    """The backend's body stopped before its end (connection lost, or silent past the read timeout)."""


class UpstreamResponse:
    """A response whose head has arrived; its body is read with `read()` or `chunks()`, then it must be closed."""

    __slots__ = ("_connection", "_pool", "_settled", "headers", "status")

    def __init__(self, pool: ConnectionPool, connection: Connection) -> None:
        self._pool = pool
        self._connection = connection
        self._settled = False
        self.status = connection.status
        self.headers = connection.headers  # names lower-cased

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as the backend sends it (undecoded), chunk by chunk as it arrives."""
        connection = self._connection
        try:
            while (chunk := await connection.next_chunk()) is not None:
                yield chunk
        except OSError as exc:  # TimeoutError and ConnectionClosed included
            raise StreamInterrupted(type(exc).__name__) from exc

    async def read(self) -> bytes:
        """The whole body; a backend that breaks off or stalls before the end is a 502 or a 504."""
        connection = self._connection
        parts: list[bytes] = []
        try:
            while (chunk := await connection.next_chunk()) is not None:
                parts.append(chunk)
        except TimeoutError as exc:
            raise UpstreamTimeout("the model backend stopped answering mid-response") from exc
        except OSError as exc:
            raise UpstreamUnreachable("the model backend broke off its response") from exc
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def aclose(self) -> None:
        # A connection left mid-body cannot carry another request: the pool closes it rather than keep it.
        if not self._settled:
            self._settled = True
            self._pool.release(self._connection, reuse=True)

    def __del__(self) -> None:
        # A response dropped unclosed (a bug) must not keep its place in the pool's count for good.
        if not self._settled:
            self._settled = True
            self._pool.release(self._connection, reuse=False)


class Upstream(Protocol):
    """The model backend as the doors call it: UpstreamClient, or the traced wrapper of one (statestore/traced.py)."""

    @property
    def base_url(self) -> str: ...

    async def send(
        self, method: str, path_and_query: str, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> UpstreamResponse: ...

    async def aclose(self) -> None: ...


class UpstreamClient:
    """Our own HTTP/1.1 client (upstream/http1.py): a LIFO keep-alive pool and httptools' C parser, without a
    general-purpose client's layers (bench/README.md)."""

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout: float,
        read_timeout: float,
        max_connections: int,
        keepalive_seconds: float = 4.0,
        pool_timeout: float = 30.0,
        metrics: Metrics | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.base_url = base_url
        self._metrics = metrics
        self._pool = ConnectionPool(
            base_url,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_connections=max_connections,
            keepalive_seconds=keepalive_seconds,
            pool_timeout=pool_timeout,
            ssl_context=ssl_context,
        )

    async def send(
        self, method: str, path_and_query: str, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> UpstreamResponse:
        """Send a request and return once the backend's response headers have arrived; the caller reads the body and
        must `aclose()` it."""
        route = _route_label(path_and_query)
        started = time.perf_counter()
        pool = self._pool
        head = pool.request_head(method, path_and_query, headers, body)
        try:
            connection = await pool.exchange(method, head, body)
        except PoolExhausted as exc:
            self._observe_failure(route, "timeout", started)
            raise UpstreamBusy("every connection to the model backend is in use; try again shortly") from exc
        except TimeoutError as exc:
            self._observe_failure(route, "timeout", started)
            raise UpstreamTimeout("the model backend did not answer in time") from exc
        except OSError as exc:
            self._observe_failure(route, "unreachable", started)
            raise UpstreamUnreachable("the model backend could not be reached") from exc
        if self._metrics is not None:
            self._metrics.observe_upstream(route, upstream_outcome(connection.status), time.perf_counter() - started)
        return UpstreamResponse(pool, connection)

    def _observe_failure(self, route: str, kind: Literal["timeout", "unreachable"], started: float) -> None:
        if self._metrics is not None:
            self._metrics.count_upstream_error(kind)
            self._metrics.observe_upstream(route, kind, time.perf_counter() - started)

    async def aclose(self) -> None:
        await self._pool.aclose()


_KNOWN_ROUTES = ("/v1/messages/count_tokens", "/v1/messages", "/v1/models")
_KNOWN_LABELS = {**{route: route for route in _KNOWN_ROUTES}, "/v1/chat/completions": "other"}


def _route_label(path_and_query: str) -> str:
    """A bounded label: the known route the path starts with, else "other"."""
    path = path_and_query.split("?", 1)[0]
    if path in _KNOWN_LABELS:  # every request of a turn: one set test
        return _KNOWN_LABELS[path]
    return next((route for route in _KNOWN_ROUTES if path == route or path.startswith(route + "/")), "other")
