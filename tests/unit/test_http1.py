"""The backend's HTTP/1.1 client (upstream/http1.py behind UpstreamClient), against scripted servers on real sockets:
each test's server writes exactly the bytes a backend could, so framing, reuse, timeouts and faults are exact."""

from __future__ import annotations

import asyncio
import socket
import ssl
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from statestore.errors import UpstreamBusy, UpstreamTimeout, UpstreamUnreachable
from statestore.upstream.client import StreamInterrupted, UpstreamClient
from statestore.upstream.http1 import Connection, ConnectionPool

Handler = Callable[["Backend", asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Backend:
    """A TCP server running `handler` per connection; it records each connection and each request head."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.heads: list[bytes] = []
        self.closed_by_client = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(self, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def start(self, ssl_context: ssl.SSLContext | None = None) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=ssl_context)
        port: int = self.server.sockets[0].getsockname()[1]
        return port

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        """One request's head and body (by its content-length), or b"" at EOF."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            self.closed_by_client.set()
            return b""
        self.heads.append(head)
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        return head + await reader.readexactly(length)


@pytest.fixture
async def backends() -> AsyncIterator[list[Backend]]:
    made: list[Backend] = []
    yield made
    for backend in made:
        if backend.server is not None:
            backend.server.close()


async def make(
    backends: list[Backend],
    handler: Handler,
    *,
    scheme: str = "http",
    path: str = "",
    server_ssl: ssl.SSLContext | None = None,
    **options: object,
) -> tuple[UpstreamClient, Backend]:
    backend = Backend(handler)
    backends.append(backend)
    port = await backend.start(server_ssl)
    settings: dict[str, object] = {"connect_timeout": 2.0, "read_timeout": 2.0, "max_connections": 8, **options}
    return UpstreamClient(f"{scheme}://127.0.0.1:{port}{path}", **settings), backend  # type: ignore[arg-type]


def replying(*responses: bytes, close: bool = False) -> Handler:
    """A backend answering each request on a connection with the next of `responses`."""

    async def handler(backend: Backend, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for response in responses:
            if not await backend.read_request(reader):
                return
            writer.write(response)
            await writer.drain()
        if not close:
            await backend.read_request(reader)  # hold the connection until the client leaves

    return handler


OK = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{"ok":true}'


async def test_a_length_delimited_body_is_read_and_the_connection_reused(backends: list[Backend]) -> None:
    client, backend = await make(backends, replying(OK, OK, OK))
    for _ in range(3):
        response = await client.send("POST", "/v1/messages", [(b"x-api-key", b"k")], b'{"a":1}')
        assert response.status == 200
        assert response.header(b"content-type") == b"application/json"
        assert await response.read() == b'{"ok":true}'
        await response.aclose()
    assert backend.connections == 1
    head = backend.heads[0].decode()
    assert head.startswith("POST /v1/messages HTTP/1.1\r\n")
    assert "\r\nx-api-key: k\r\n" in head and "\r\ncontent-length: 7\r\n" in head
    assert f"\r\nhost: 127.0.0.1:{backend.server.sockets[0].getsockname()[1]}\r\n" in head  # type: ignore[union-attr]
    await client.aclose()


async def test_a_chunked_stream_is_relayed_as_it_arrives(backends: list[Backend]) -> None:
    release = asyncio.Event()

    async def handler(backend: Backend, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await backend.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(b"7\r\nevent 1\r\n")
        await writer.drain()
        await release.wait()  # the client must have the first chunk before the second is sent
        writer.write(b"7\r\nevent 2\r\n0\r\n\r\n")
        await writer.drain()
        await backend.read_request(reader)

    client, _ = await make(backends, handler)
    response = await client.send("POST", "/v1/messages", [], b"{}")
    chunks = response.chunks()
    assert await anext(chunks) == b"event 1"
    release.set()
    assert [chunk async for chunk in chunks] == [b"event 2"]
    await response.aclose()
    assert response.header(b"transfer-encoding") == b"chunked"
    await client.aclose()


async def test_a_body_without_length_ends_with_the_connection_and_is_not_reused(backends: list[Backend]) -> None:
    client, backend = await make(backends, replying(b"HTTP/1.1 200 OK\r\n\r\nuntil the end", close=True))
    response = await client.send("GET", "/v1/models", [], b"")
    assert await response.read() == b"until the end"
    await response.aclose()
    assert b"content-length" not in backend.heads[0]  # a GET without a body has no length
    backend.handler = replying(OK)
    response = await client.send("GET", "/v1/models", [], b"")
    assert await response.read() == b'{"ok":true}'
    await response.aclose()
    assert backend.connections == 2
    await client.aclose()


async def test_connection_close_is_honoured(backends: list[Backend]) -> None:
    closing = b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nhi"
    client, backend = await make(backends, replying(closing, closing, close=True))
    for _ in range(2):
        response = await client.send("POST", "/v1/messages", [], b"")
        assert await response.read() == b"hi"
        await response.aclose()
    assert backend.connections == 2
    assert b"\r\ncontent-length: 0\r\n" in backend.heads[0]  # a POST always says its length
    await client.aclose()


async def test_a_connection_the_backend_closed_while_idle_is_not_used_again(backends: list[Backend]) -> None:
    client, backend = await make(backends, replying(OK, close=True))
    response = await client.send("POST", "/v1/messages", [], b"{}")
    await response.read()
    await response.aclose()
    for _ in range(100):  # until the client has seen the close
        if not client._pool._idle:
            break
        await asyncio.sleep(0.01)
    assert not client._pool._idle
    response = await client.send("POST", "/v1/messages", [], b"{}")
    assert await response.read() == b'{"ok":true}'
    await response.aclose()
    assert backend.connections == 2
    await client.aclose()


def closing_after_first(first: bytes) -> Handler:
    """Answers the first request, then reads the next one and closes without a byte: a keep-alive race lost."""

    async def handler(backend: Backend, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if backend.connections == 1:
            await backend.read_request(reader)
            writer.write(first)
            await writer.drain()
            await backend.read_request(reader)
            return  # closed unanswered
        await replying(OK)(backend, reader, writer)

    return handler


async def test_an_idempotent_request_is_retried_once_when_a_reused_connection_was_closed(
    backends: list[Backend],
) -> None:
    client, backend = await make(backends, closing_after_first(OK))
    first = await client.send("GET", "/v1/models", [], b"")
    await first.read()
    await first.aclose()
    second = await client.send("GET", "/v1/models", [], b"")
    assert await second.read() == b'{"ok":true}'
    await second.aclose()
    assert backend.connections == 2 and len(backend.heads) == 3
    await client.aclose()


async def test_a_post_is_never_sent_twice(backends: list[Backend]) -> None:
    client, backend = await make(backends, closing_after_first(OK))
    first = await client.send("POST", "/v1/messages", [], b"{}")
    await first.read()
    await first.aclose()
    with pytest.raises(UpstreamUnreachable):
        await client.send("POST", "/v1/messages", [], b"{}")
    assert backend.connections == 1 and len(backend.heads) == 2
    await client.aclose()


async def test_a_backend_silent_past_the_read_timeout(backends: list[Backend]) -> None:
    async def silent_after_head(backend: Backend, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await backend.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    async def silent(backend: Backend, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await backend.read_request(reader)
        await asyncio.sleep(5)

    client, _ = await make(backends, silent_after_head, read_timeout=0.2)
    response = await client.send("POST", "/v1/messages", [], b"{}")
    chunks = response.chunks()
    assert await anext(chunks) == b"hello"
    with pytest.raises(StreamInterrupted, match="TimeoutError"):
        await anext(chunks)
    await response.aclose()
    response = await client.send("POST", "/v1/messages", [], b"{}")  # the broken connection was not kept
    with pytest.raises(UpstreamTimeout):
        await response.read()
    await response.aclose()
    await client.aclose()

    client, _ = await make(backends, silent, read_timeout=0.2)
    with pytest.raises(UpstreamTimeout):
        await client.send("POST", "/v1/messages", [], b"{}")
    await client.aclose()


async def test_a_response_that_is_not_http_or_breaks_off(backends: list[Backend]) -> None:
    client, _ = await make(backends, replying(b"SSH-2.0-OpenSSH\r\n\r\n", close=True))
    with pytest.raises(UpstreamUnreachable):
        await client.send("POST", "/v1/messages", [], b"{}")
    await client.aclose()

    cut = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part"
    client, _ = await make(backends, replying(cut, close=True))
    response = await client.send("POST", "/v1/messages", [], b"{}")
    with pytest.raises(UpstreamUnreachable):
        await response.read()
    await response.aclose()
    response = await client.send("POST", "/v1/messages", [], b"{}")
    with pytest.raises(StreamInterrupted, match="ConnectionClosed"):
        async for _ in response.chunks():
            pass
    await response.aclose()
    await client.aclose()


async def test_an_unreachable_backend() -> None:
    client = UpstreamClient("http://127.0.0.1:9", connect_timeout=1, read_timeout=1, max_connections=2)
    with pytest.raises(UpstreamUnreachable):
        await client.send("POST", "/v1/messages", [], b"{}")
    await client.aclose()


async def test_interim_responses_are_skipped_and_head_has_no_body(backends: list[Backend]) -> None:
    interim = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n" + OK
    client, _ = await make(backends, replying(interim, b"HTTP/1.1 200 OK\r\ncontent-length: 50\r\n\r\n"))
    response = await client.send("POST", "/v1/messages", [], b"{}")
    assert response.status == 200 and response.header(b"link") is None
    assert await response.read() == b'{"ok":true}'
    await response.aclose()
    response = await client.send("HEAD", "/v1/models", [], b"")
    assert response.header(b"content-length") == b"50"
    assert await response.read() == b""
    await response.aclose()
    assert not client._pool._idle  # after HEAD the connection goes: its framing cannot be trusted
    await client.aclose()


async def test_the_pool_limit_queues_requests_and_a_cancelled_waiter_passes_its_turn(backends: list[Backend]) -> None:
    client, backend = await make(backends, replying(OK, OK, OK), max_connections=1)
    held = await client.send("POST", "/v1/messages", [], b"{}")
    queued = [asyncio.ensure_future(client.send("POST", "/v1/messages", [], b"{}")) for _ in range(2)]
    async with asyncio.timeout(5):
        while len(client._pool._waiters) < 2:  # both queued behind the one connection
            await asyncio.sleep(0)
    assert not any(task.done() for task in queued)
    queued[0].cancel()
    await held.read()
    await held.aclose()
    response = await asyncio.wait_for(queued[1], 2)
    assert await response.read() == b'{"ok":true}'
    await response.aclose()
    assert backend.connections == 1
    await client.aclose()


async def test_a_request_waits_for_a_connection_at_most_the_pool_timeout(backends: list[Backend]) -> None:
    """Every connection in use past the pool timeout: the waiting request is refused with a retryable 503, unsent,
    and leaves the line; the pool serves the next request once the connection is back."""
    client, backend = await make(backends, replying(OK, OK), max_connections=1, pool_timeout=0.2)
    held = await client.send("POST", "/v1/messages", [], b"{}")
    started = asyncio.get_running_loop().time()
    with pytest.raises(UpstreamBusy) as refused:
        await asyncio.wait_for(client.send("POST", "/v1/messages", [], b"{}"), 5)
    assert 0.15 <= asyncio.get_running_loop().time() - started < 2
    assert refused.value.status == 503 and refused.value.headers["retry-after"]
    assert len(backend.heads) == 1  # the refused request never reached the backend
    assert not client._pool._waiters
    await held.read()
    await held.aclose()
    response = await asyncio.wait_for(client.send("POST", "/v1/messages", [], b"{}"), 2)
    assert await response.read() == b'{"ok":true}'
    await response.aclose()
    assert backend.connections == 1
    await client.aclose()


async def test_request_target_and_line_breaks(backends: list[Backend]) -> None:
    client, backend = await make(backends, replying(OK, OK), path="/base/")
    response = await client.send("GET", "/v1/models/a b%?x=1&y=%20", [], b"")
    await response.aclose()
    assert backend.heads[0].startswith(b"GET /base/v1/models/a%20b%25?x=1&y=%20 HTTP/1.1\r\n")
    for bad in (
        [(b"x-api-key", b"k\r\nx-evil: 1")],
        [(b"x-api-key", b"k\nx-evil: 1")],
        [(b"a", b"1"), (b"x-api-key", b"k\r")],
        [(b"x-evil\n", b"1"), (b"a", b"1")],
    ):
        with pytest.raises(ValueError, match="line break"):
            await client.send("POST", "/v1/messages", bad, b"{}")
    response = await client.send("POST", "/v1/messages", [(b"a", b"1"), (b"b", b"2")], b"{}")
    await response.aclose()
    assert backend.heads[1].startswith(b"POST /base/v1/messages HTTP/1.1\r\nhost: ")
    assert backend.heads[1].endswith(b"\r\na: 1\r\nb: 2\r\ncontent-length: 2\r\n\r\n")
    await client.aclose()


async def test_a_slow_reader_gets_a_large_body_whole(backends: list[Backend]) -> None:
    body = bytes(range(256)) * 20_000  # 5 MB: past the read-pause mark many times
    client, _ = await make(
        backends, replying(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body, close=True)
    )
    response = await client.send("POST", "/v1/messages", [], b"{}")
    received = bytearray()
    async for chunk in response.chunks():
        received += chunk
        await asyncio.sleep(0)
    assert bytes(received) == body
    await response.aclose()
    await client.aclose()


async def test_idle_connections_past_the_keepalive_are_closed(backends: list[Backend]) -> None:
    client, backend = await make(backends, replying(OK), keepalive_seconds=0.1)
    response = await client.send("POST", "/v1/messages", [], b"{}")
    await response.read()
    await response.aclose()
    await asyncio.wait_for(backend.closed_by_client.wait(), 2)  # the sweep closed it, with no request to prompt it
    assert not client._pool._idle and client._pool._open == 0
    await client.aclose()


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"),
            *("-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


async def test_https_verifies_the_backend(backends: list[Backend], certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    server_ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ssl.load_cert_chain(cert, key)
    trusting = ssl.create_default_context(cafile=str(cert))
    client, _ = await make(backends, replying(OK), scheme="https", server_ssl=server_ssl, ssl_context=trusting)
    response = await client.send("POST", "/v1/messages", [], b"{}")
    assert await response.read() == b'{"ok":true}'
    await response.aclose()
    await client.aclose()

    client, _ = await make(backends, replying(OK), scheme="https", server_ssl=server_ssl)  # the system's roots only
    with pytest.raises(UpstreamUnreachable) as caught:
        await client.send("POST", "/v1/messages", [], b"{}")
    assert isinstance(caught.value.__cause__, ssl.SSLCertVerificationError)
    await client.aclose()


async def test_a_response_dropped_unclosed_gives_its_connection_back(backends: list[Backend]) -> None:
    client, backend = await make(backends, replying(OK, OK), max_connections=1)
    response = await client.send("POST", "/v1/messages", [], b"{}")
    del response  # never read nor closed
    again = await asyncio.wait_for(client.send("POST", "/v1/messages", [], b"{}"), 2)
    assert await again.read() == b'{"ok":true}'
    await again.aclose()
    assert backend.connections == 2  # the dropped one was closed, not reused mid-response
    await client.aclose()


async def test_bytes_after_the_response_close_the_connection_and_leave_the_response_whole(
    backends: list[Backend],
) -> None:
    trailing = OK + b"HTTP/1.1 200 OK\r\nx-smuggled: 1\r\ncontent-length: 2\r\n\r\nno"
    client, backend = await make(backends, replying(trailing, OK))
    response = await client.send("POST", "/v1/messages", [], b"{}")
    assert await response.read() == b'{"ok":true}'
    assert response.header(b"x-smuggled") is None
    await response.aclose()
    again = await client.send("POST", "/v1/messages", [], b"{}")
    assert await again.read() == b'{"ok":true}'
    await again.aclose()
    assert backend.connections == 2  # the first connection was not trusted again
    await client.aclose()


class FakeTransport:
    def __init__(self) -> None:
        self.paused = False
        self.written: list[bytes] = []

    def writelines(self, data: list[bytes]) -> None:
        self.written += data

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def close(self) -> None:
        pass


async def test_reading_paused_with_the_body_unread_keeps_the_connection_out_of_the_pool() -> None:
    pool = ConnectionPool(
        "http://127.0.0.1:1", connect_timeout=1, read_timeout=1, max_connections=1, keepalive_seconds=1
    )
    connection = Connection(pool)
    transport = FakeTransport()
    connection.connection_made(transport)  # type: ignore[arg-type]
    connection.send(b"POST / HTTP/1.1\r\n\r\n", b"")
    body = b"z" * 300_000  # past the pause mark, and the whole response, in one read
    connection.data_received(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
    assert transport.paused and connection.message_done
    assert not connection.reusable  # closed now, it would sit in the pool with reading paused for good
    assert await connection.next_chunk() == body
    assert not transport.paused and connection.reusable


async def test_a_host_name_is_resolved_and_its_addresses_tried_until_one_answers(backends: list[Backend]) -> None:
    # The backend listens on 127.0.0.1 only; "localhost" may resolve to ::1 first, which refuses.
    backend = Backend(replying(OK))
    backends.append(backend)
    port = await backend.start()
    client = UpstreamClient(f"http://localhost:{port}", connect_timeout=2, read_timeout=2, max_connections=2)
    response = await client.send("POST", "/v1/messages", [], b"{}")
    assert await response.read() == b'{"ok":true}'
    await response.aclose()
    assert f"\r\nhost: localhost:{port}\r\n".encode() in backend.heads[0]
    await client.aclose()
    with pytest.raises(UpstreamUnreachable):
        unknown = UpstreamClient("http://no-such-host.invalid", connect_timeout=2, read_timeout=2, max_connections=2)
        try:
            await unknown.send("GET", "/v1/models", [], b"")
        finally:
            await unknown.aclose()


async def test_an_address_that_drops_connections_does_not_use_up_the_connect_timeout(
    backends: list[Backend], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A listener whose accept queue is full drops further SYNs: a connection to it hangs, like a dead IPv6 route.
    blackhole = socket.socket()
    blackhole.bind(("127.0.0.2", 0))
    blackhole.listen(0)
    fillers = [socket.socket() for _ in range(4)]
    for filler in fillers:
        filler.setblocking(False)
        filler.connect_ex(blackhole.getsockname())
    await asyncio.sleep(0.2)
    client, backend = await make(backends, replying(OK), connect_timeout=1.5)
    port = backend.server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def resolve(*_: object, **__: object) -> list[tuple[int, int, int, str, tuple[str, int]]]:
        return [
            (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", blackhole.getsockname()),
            (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("127.0.0.1", port)),
        ]

    monkeypatch.setattr(client._pool.loop, "getaddrinfo", resolve)
    started = time.monotonic()
    response = await client.send("POST", "/v1/messages", [], b"{}")
    assert await response.read() == b'{"ok":true}'
    assert time.monotonic() - started < 1.0  # the second address was tried after 0.25 s, not after the first gave up
    await response.aclose()
    await client.aclose()
    for sock in (*fillers, blackhole):
        sock.close()
