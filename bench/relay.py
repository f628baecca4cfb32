"""Arm R: the bare pass-through relay, the floor for any Python relay in front of the backend.

A few lines of raw ASGI and one pooled HTTP client, served by uvicorn with uvloop and httptools: read the body,
forward it with the headers minus hop-by-hop ones, stream the response back chunk by chunk. No routing, no
validation, no logging, no metrics. The client is aiohttp (the default, and what statestore used before it had a
client of its own), httpx (whose pool cost grows with the connections in flight), or statestore's own
(statestore/upstream/http1.py); `--client` picks.

    python -m bench.relay --port 8091 --upstream http://127.0.0.1:8090 [--client aiohttp|httpx|statestore]
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from typing import Protocol

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from statestore.upstream.client import UpstreamClient

_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade"})
_NOT_FORWARDED = _HOP_BY_HOP | {b"host", b"content-length"}  # the client writes its own
_NOT_RETURNED = _HOP_BY_HOP | {b"date"}  # uvicorn writes its own


class Upstream(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def request(
        self, method: str, url: str, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> tuple[int, list[tuple[bytes, bytes]], AsyncIterator[bytes]]: ...


class HttpxUpstream:
    def __init__(self) -> None:
        import httpx

        self._httpx = httpx
        self._client: httpx.AsyncClient | None = None

    async def start(self) -> None:
        self._client = self._httpx.AsyncClient(
            timeout=self._httpx.Timeout(600.0, connect=10.0),
            limits=self._httpx.Limits(max_connections=200, max_keepalive_connections=200),
            trust_env=False,
        )

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def request(
        self, method: str, url: str, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> tuple[int, list[tuple[bytes, bytes]], AsyncIterator[bytes]]:
        assert self._client is not None
        response = await self._client.send(
            self._client.build_request(method, url, headers=headers, content=body), stream=True
        )

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()

        return response.status_code, [(k.lower(), v) for k, v in response.headers.raw], chunks()


class AiohttpUpstream:
    def __init__(self) -> None:
        import aiohttp

        self._aiohttp = aiohttp
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        aiohttp = self._aiohttp
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=200, limit_per_host=200),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=600.0),
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            trust_env=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
        )

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def request(
        self, method: str, url: str, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> tuple[int, list[tuple[bytes, bytes]], AsyncIterator[bytes]]:
        assert self._session is not None
        response = await self._session.request(
            method,
            url,
            headers=[(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers],
            data=body,
            allow_redirects=False,
        )

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.content.iter_any():
                    yield chunk
            finally:
                response.release()

        return response.status, [(k.lower(), v) for k, v in response.raw_headers], chunks()


class StatestoreUpstream:
    """statestore's own client (statestore/upstream/http1.py): what a bare relay on it costs."""

    def __init__(self, upstream_url: str) -> None:
        self._base = upstream_url.rstrip("/")
        self._client: UpstreamClient | None = None

    async def start(self) -> None:
        self._client = UpstreamClient(self._base, connect_timeout=10.0, read_timeout=600.0, max_connections=200)

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def request(
        self, method: str, url: str, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> tuple[int, list[tuple[bytes, bytes]], AsyncIterator[bytes]]:
        assert self._client is not None
        response = await self._client.send(method, url[len(self._base) :], headers, body)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.chunks():
                    yield chunk
            finally:
                await response.aclose()

        return response.status, response.headers, chunks()


class Relay:
    def __init__(self, upstream_url: str, client: Upstream) -> None:
        self._upstream_url = upstream_url.rstrip("/")
        self._client = client

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                event = await receive()
                if event["type"] == "lifespan.startup":
                    await self._client.start()
                    await send({"type": "lifespan.startup.complete"})
                elif event["type"] == "lifespan.shutdown":
                    await self._client.stop()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        parts = []
        while True:
            message = await receive()
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        headers = [(name, value) for name, value in scope["headers"] if name not in _NOT_FORWARDED]
        query = scope["query_string"]
        url = self._upstream_url + scope["path"] + ("?" + query.decode() if query else "")
        status, response_headers, chunks = await self._client.request(scope["method"], url, headers, b"".join(parts))
        out = [(name, value) for name, value in response_headers if name not in _NOT_RETURNED]
        await send({"type": "http.response.start", "status": status, "headers": out})
        async for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


CLIENTS = ("aiohttp", "httpx", "statestore")


def client_named(name: str, upstream_url: str) -> Upstream:
    if name == "statestore":
        return StatestoreUpstream(upstream_url)
    return AiohttpUpstream() if name == "aiohttp" else HttpxUpstream()


def default_client() -> str:
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        return "httpx"
    return "aiohttp"


def serve_bare(app: ASGIApp, host: str, port: int) -> None:
    """uvicorn as the bare arms run it: uvloop and httptools, no access log, nothing else."""
    uvicorn.run(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        log_level="warning",
        server_header=False,
    )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.relay", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--client", choices=CLIENTS, default=default_client())
    args = parser.parse_args()
    serve_bare(Relay(args.upstream, client_named(args.client, args.upstream)), args.host, args.port)


if __name__ == "__main__":
    main()
