"""The one pooled HTTP client to the model backend, created in the app's lifespan.

Relays keep the backend's status, headers and body bytes; only hop-by-hop headers and those statestore owns are
dropped on the way in and out (PROTOCOL §1).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable
from typing import Literal

import aiohttp
from multidict import CIMultiDict

from statestore.errors import UpstreamTimeout, UpstreamUnreachable
from statestore.metrics import Metrics, upstream_outcome

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
# Recomputed by whoever writes the body next.
_BODY_FRAMING = frozenset({b"content-length", b"host"})
_CREDENTIALS = frozenset({b"x-api-key", b"authorization"})
# The server adds its own.
_SERVER_OWNED = frozenset({b"date"})


def request_headers_for_upstream(
    headers: Iterable[tuple[bytes, bytes]], *, threaded: bool, credential: tuple[bytes, bytes] | None = None
) -> list[tuple[bytes, bytes]]:
    """The client's headers as the backend should see them: credentials and `anthropic-*` kept, hop-by-hop headers,
    `statestore-*` and the threads beta removed. A threaded turn asks for an uncompressed reply because statestore
    reads it. With a `credential` (keys mode) the client's credential headers are replaced by it."""
    out: list[tuple[bytes, bytes]] = []
    for raw_name, value in headers:
        name = raw_name.lower()
        if name in _HOP_BY_HOP or name in _BODY_FRAMING or name.startswith(b"statestore-"):
            continue
        if credential is not None and name in _CREDENTIALS:
            continue
        if name == b"anthropic-beta":
            betas = [b.strip() for b in value.split(b",") if b.strip() and b.strip() != THREADS_BETA.encode()]
            if betas:
                out.append((name, b",".join(betas)))
            continue
        if threaded and name == b"accept-encoding":
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
        if name in _HOP_BY_HOP or name in _SERVER_OWNED or (name == b"content-length" and not keep_length):
            continue
        out.append((name, value))
    return out


class StreamInterrupted(Exception):
    """The backend's body stopped before its end (connection lost, or silent past the read timeout)."""


_TRANSPORT_ERRORS = (aiohttp.ClientError, OSError)
# The client's headers are forwarded as they are; aiohttp must not add its own.
_NO_AUTO_HEADERS = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")


class UpstreamResponse:
    __slots__ = ("_response", "headers", "status")

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status
        self.headers = [(name.lower(), value) for name, value in response.raw_headers]

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as the backend sends it (undecoded), chunk by chunk as it arrives."""
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (TimeoutError, *_TRANSPORT_ERRORS) as exc:
            raise StreamInterrupted(type(exc).__name__) from exc

    async def read(self) -> bytes:
        """The whole body; a backend that breaks off or stalls before the end is a 502 or a 504."""
        try:
            return await self._response.read()
        except TimeoutError as exc:
            raise UpstreamTimeout("the model backend stopped answering mid-response") from exc
        except _TRANSPORT_ERRORS as exc:
            raise UpstreamUnreachable("the model backend broke off its response") from exc

    async def aclose(self) -> None:
        # A connection left mid-body cannot carry another request: close it rather than return it to the pool.
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()


class UpstreamClient:
    """aiohttp: its pool hands out a connection in O(1) and parses responses in C; the relay's CPU per request is a
    fraction of a general-purpose client's (bench/README.md)."""

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout: float,
        read_timeout: float,
        max_connections: int,
        keepalive_seconds: float = 4.0,
        metrics: Metrics | None = None,
    ) -> None:
        self.base_url = base_url
        self._metrics = metrics
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=max_connections, limit_per_host=max_connections, keepalive_timeout=keepalive_seconds
            ),
            timeout=aiohttp.ClientTimeout(
                total=None, connect=connect_timeout, sock_connect=connect_timeout, sock_read=read_timeout
            ),
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            trust_env=False,
            skip_auto_headers=_NO_AUTO_HEADERS,
        )

    async def send(
        self, method: str, path_and_query: str, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> UpstreamResponse:
        """Send a request and return once the backend's response headers have arrived; the caller reads the body and
        must `aclose()` it."""
        route = _route_label(path_and_query)
        started = time.perf_counter()
        try:
            response = await self._session.request(
                method,
                self.base_url + path_and_query,
                headers=CIMultiDict((name.decode("latin-1"), value.decode("latin-1")) for name, value in headers),
                data=body if body or method not in ("GET", "HEAD") else None,
                allow_redirects=False,
                compress=None,
            )
        except TimeoutError as exc:
            self._observe_failure(route, "timeout", started)
            raise UpstreamTimeout("the model backend did not answer in time") from exc
        except _TRANSPORT_ERRORS as exc:
            self._observe_failure(route, "unreachable", started)
            raise UpstreamUnreachable("the model backend could not be reached") from exc
        if self._metrics is not None:
            self._metrics.observe_upstream(route, upstream_outcome(response.status), time.perf_counter() - started)
        return UpstreamResponse(response)

    def _observe_failure(self, route: str, kind: Literal["timeout", "unreachable"], started: float) -> None:
        if self._metrics is not None:
            self._metrics.count_upstream_error(kind)
            self._metrics.observe_upstream(route, kind, time.perf_counter() - started)

    async def aclose(self) -> None:
        await self._session.close()


_KNOWN_ROUTES = ("/v1/messages/count_tokens", "/v1/messages", "/v1/models")


def _route_label(path_and_query: str) -> str:
    """A bounded label: the known route the path starts with, else "other"."""
    path = path_and_query.split("?", 1)[0]
    return next((route for route in _KNOWN_ROUTES if path == route or path.startswith(route + "/")), "other")
