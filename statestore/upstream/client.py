"""The one pooled HTTP client to the model backend, created in the app's lifespan.

Relays keep the backend's status, headers and body bytes; only hop-by-hop headers and those statestore owns are
dropped on the way in and out (PROTOCOL §1).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Literal

import httpx

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


@dataclass(slots=True)
class UpstreamResponse:
    status: int
    headers: list[tuple[bytes, bytes]]
    _response: httpx.Response

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as the backend sends it (undecoded), chunk by chunk."""
        async for chunk in self._response.aiter_raw():
            yield chunk

    async def read(self) -> bytes:
        """The whole body; a backend that breaks off or stalls before the end is a 502 or a 504."""
        try:
            return b"".join([chunk async for chunk in self._response.aiter_raw()])
        except httpx.TimeoutException as exc:
            raise UpstreamTimeout("the model backend stopped answering mid-response") from exc
        except (httpx.TransportError, OSError) as exc:
            raise UpstreamUnreachable("the model backend broke off its response") from exc

    async def aclose(self) -> None:
        await self._response.aclose()


class UpstreamClient:
    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout: float,
        read_timeout: float,
        max_connections: int,
        metrics: Metrics | None = None,
    ) -> None:
        self.base_url = base_url
        self._metrics = metrics
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(read_timeout, connect=connect_timeout, pool=connect_timeout),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            follow_redirects=False,
            trust_env=False,
        )

    async def send(
        self, method: str, path_and_query: str, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> UpstreamResponse:
        """Send a request and return once the backend's response headers have arrived; the caller reads the body and
        must `aclose()` it."""
        request = self._client.build_request(method, self.base_url + path_and_query, headers=headers, content=body)
        route = _route_label(path_and_query)
        started = time.perf_counter()
        try:
            response = await self._client.send(request, stream=True)
        except httpx.TimeoutException as exc:
            self._observe_failure(route, "timeout", started)
            raise UpstreamTimeout("the model backend did not answer in time") from exc
        except (httpx.TransportError, OSError) as exc:
            self._observe_failure(route, "unreachable", started)
            raise UpstreamUnreachable("the model backend could not be reached") from exc
        if self._metrics is not None:
            self._metrics.observe_upstream(route, upstream_outcome(response.status_code), time.perf_counter() - started)
        return UpstreamResponse(response.status_code, [(k.lower(), v) for k, v in response.headers.raw], response)

    def _observe_failure(self, route: str, kind: Literal["timeout", "unreachable"], started: float) -> None:
        if self._metrics is not None:
            self._metrics.count_upstream_error(kind)
            self._metrics.observe_upstream(route, kind, time.perf_counter() - started)

    async def aclose(self) -> None:
        await self._client.aclose()


_KNOWN_ROUTES = ("/v1/messages/count_tokens", "/v1/messages", "/v1/models")


def _route_label(path_and_query: str) -> str:
    """A bounded label: the known route the path starts with, else "other"."""
    path = path_and_query.split("?", 1)[0]
    return next((route for route in _KNOWN_ROUTES if path == route or path.startswith(route + "/")), "other")
