"""Loopback TCP plumbing of the campaign: a fault-injecting proxy in front of PostgreSQL, Redis and the backend, and a
round-robin balancer in front of the statestore replicas.

Both run on an event loop of their own in a background thread (`NetworkLoop`), so that blocking calls of the test
(a replica starting, `pg_ctl`) never stall the bytes that those very processes need. Faults are plain attributes that
the pumps read on every chunk; setting one from another thread takes effect on the next chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import struct
import threading
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from tests.support.server import free_port

T = TypeVar("T")
CHUNK = 65536


class NetworkLoop:
    """An asyncio loop in a daemon thread; `call` runs a coroutine there and waits for its result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="campaign-network", daemon=True)
        self._thread.start()

    def call(self, coroutine: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


def _abort(writer: asyncio.StreamWriter, *, reset: bool) -> None:
    """Close a connection at once; with `reset`, by RST (SO_LINGER 0) rather than FIN."""
    if reset:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@dataclass
class LinkFaults:
    """What the proxy does to the bytes now. `stalled`: nothing moves (a black hole; connections stay open);
    `refuse`: new connections are closed as soon as they arrive; `latency`: seconds added to every chunk;
    `bytes_per_second`: a bandwidth cap (0: none)."""

    stalled: bool = False
    refuse: bool = False
    latency: float = 0.0
    bytes_per_second: int = 0
    # Once: the connection whose client sends these bytes gets no more replies and is reset shortly after, while
    # what it sent still reaches the server (a request the server carried out, its answer lost on the way back).
    lose_reply_after: bytes | None = None
    # Once, PostgreSQL only: the connection whose client sends these bytes loses the reply that ends their
    # transaction (the first ReadyForQuery that reports the connection idle), and is reset: a COMMIT, or a statement
    # that commits by itself, carried out, its acknowledgement lost.
    lose_commit_reply_after: bytes | None = None
    # With lose_commit_reply_after: only bytes sent outside a transaction arm it (a statement that commits by itself,
    # not one inside BEGIN ... COMMIT), and `on_commit_lost` runs the moment that commit's acknowledgement is withheld.
    lose_commit_alone: bool = False
    on_commit_lost: Callable[[], None] | None = None
    # Once: the chunk from the client that carries these bytes never reaches the server, and the connection is reset
    # (a request lost on its way: nothing of it carried out).
    drop_request_with: bytes | None = None

    def clear(self) -> None:
        self.stalled = self.refuse = False
        self.latency = 0.0
        self.bytes_per_second = 0
        self.lose_reply_after = self.lose_commit_reply_after = self.drop_request_with = None
        self.lose_commit_alone = False
        self.on_commit_lost = None


class _Pipes:
    """The open connection pairs of a proxy or balancer, so that a fault can cut them all."""

    def __init__(self) -> None:
        self.pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()

    def cut(self, *, reset: bool) -> int:
        pairs, self.pairs = self.pairs, set()
        for client, upstream in pairs:
            _abort(client, reset=reset)
            _abort(upstream, reset=reset)
        return len(pairs)


LOSE_REPLY_DELAY = 0.3


# PostgreSQL's ReadyForQuery, then its transaction status (I idle, T in a transaction, E failed transaction); idle
# ends the reply to a transaction's last statement.
READY = b"Z\x00\x00\x00\x05"
READY_IDLE = READY + b"I"


@dataclass
class _Link:
    client: asyncio.StreamWriter
    replies_lost: bool = False
    commit_armed: bool = False  # lose_commit_reply_after: the marker went by; the reply ending its transaction goes
    in_transaction: bool = False  # PostgreSQL: the last ReadyForQuery said a transaction is open


async def _pump(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    faults: LinkFaults | None,
    link: _Link,
    *,
    to_server: bool,
) -> None:
    try:
        while data := await reader.read(CHUNK):
            if faults is not None:
                marker = faults.lose_reply_after
                if to_server and marker is not None and marker in data:
                    faults.lose_reply_after = None
                    link.replies_lost = True
                    # Later than the server needs to carry out what it was sent; then the client sees a reset.
                    cut = functools.partial(_abort, link.client, reset=True)
                    asyncio.get_running_loop().call_later(LOSE_REPLY_DELAY, cut)
                dropping = faults.drop_request_with
                if to_server and dropping is not None and dropping in data:
                    faults.drop_request_with = None
                    _abort(writer, reset=True)
                    _abort(link.client, reset=True)
                    return
                committing = faults.lose_commit_reply_after
                if not to_server and (ready := data.rfind(READY)) >= 0 and ready + 5 < len(data):
                    link.in_transaction = data[ready + 5 : ready + 6] != b"I"
                alone = not (faults.lose_commit_alone and link.in_transaction)
                if to_server and committing is not None and committing in data and alone:
                    faults.lose_commit_reply_after = None
                    link.commit_armed = True
                if not to_server and link.commit_armed and READY_IDLE in data:
                    # The server has committed (it says the connection is idle again): the client never hears it.
                    link.commit_armed = False
                    link.replies_lost = True
                    then, faults.on_commit_lost = faults.on_commit_lost, None
                    if then is not None:
                        then()
                    _abort(link.client, reset=True)
                while faults.stalled:
                    await asyncio.sleep(0.05)
                if faults.latency:
                    await asyncio.sleep(faults.latency)
                if faults.bytes_per_second:
                    await asyncio.sleep(len(data) / faults.bytes_per_second)
            if link.replies_lost and not to_server:
                continue
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        _abort(writer, reset=True)


async def _splice(
    pipes: _Pipes,
    client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    faults: LinkFaults | None = None,
) -> None:
    pair = (client[1], upstream[1])
    link = _Link(client[1])
    pipes.pairs.add(pair)
    try:
        await asyncio.gather(
            _pump(client[0], upstream[1], faults, link, to_server=True),
            _pump(upstream[0], client[1], faults, link, to_server=False),
        )
    finally:
        pipes.pairs.discard(pair)
        for writer in pair:
            writer.transport.abort() if writer.transport.is_closing() else writer.close()


class FaultProxy:
    """127.0.0.1:`port` -> 127.0.0.1:`target_port`, with `faults` applied to both directions."""

    def __init__(self, network: NetworkLoop, name: str, target_port: int) -> None:
        self.name = name
        self.target_port = target_port
        self.port = free_port()
        self.faults = LinkFaults()
        self._pipes = _Pipes()
        self._network = network
        self._server = network.call(asyncio.start_server(self._accept, "127.0.0.1", self.port))

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.faults.refuse:
            _abort(writer, reset=True)
            return
        try:
            upstream = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", self.target_port), 5)
        except (OSError, TimeoutError):
            _abort(writer, reset=True)
            return
        await _splice(self._pipes, (reader, writer), upstream, self.faults)

    def cut(self, *, reset: bool) -> int:
        """Close every open connection: by RST (`reset`) or FIN. Returns how many were cut."""

        async def go() -> int:
            return self._pipes.cut(reset=reset)

        return self._network.call(go())

    def close(self) -> None:
        async def go() -> None:
            self._server.close()
            self._pipes.cut(reset=True)

        self._network.call(go())


class Balancer:
    """A TCP load balancer: each new connection goes to the next replica in turn; a replica that refuses the connect
    is skipped (as HAProxy's `redispatch` does for a failed connect). A request already sent is never replayed."""

    def __init__(self, network: NetworkLoop, ports: Callable[[], Sequence[int]]) -> None:
        self._ports = ports
        self._next = 0
        self._pipes = _Pipes()
        self._network = network
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = network.call(asyncio.start_server(self._accept, "127.0.0.1", self.port, backlog=1024))

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ports = list(self._ports())
        for attempt in range(len(ports)):
            port = ports[(self._next + attempt) % len(ports)]
            try:
                upstream = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 2)
            except (OSError, TimeoutError):
                continue
            self._next = (self._next + attempt + 1) % len(ports)
            await _splice(self._pipes, (reader, writer), upstream)
            return
        _abort(writer, reset=True)

    def close(self) -> None:
        async def go() -> None:
            self._server.close()
            self._pipes.cut(reset=True)

        self._network.call(go())
