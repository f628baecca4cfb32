"""A Redis Cluster's client holds a breaker per node (store/resp_cluster.py): a black-holed master costs the cache one
timeout per pause on its own slots, and the other masters keep serving theirs meanwhile."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import hiredis
import pytest

from statestore.store.resp import RedisBreaker, RedisSkipped
from statestore.store.resp_cluster import SLOTS, ClusterClient, key_slot
from statestore.store.resp_reader import RedisTimeout


def _bulk(data: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(data), data)


@dataclass
class FakeNode:
    """A master of a two-node cluster that serves GET with its own name; `hung`: it reads and never answers."""

    name: bytes
    ports: list[int]
    hung: bool = False
    port: int = 0
    asked: list[bytes] = field(default_factory=list)

    def slots(self) -> bytes:
        half = SLOTS // 2
        ranges = [(0, half - 1, self.ports[0]), (half, SLOTS - 1, self.ports[1])]
        entries = [
            b"*3\r\n:%d\r\n:%d\r\n*2\r\n%s:%d\r\n" % (start, end, _bulk(b"127.0.0.1"), port)
            for start, end, port in ranges
        ]
        return b"*2\r\n" + b"".join(entries)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        parser = hiredis.Reader()
        while data := await reader.read(65536):
            parser.feed(data)
            while (command := parser.gets()) is not False:
                self.asked.append(command[0].upper())
                if self.hung:
                    continue
                writer.write(self.slots() if command[0].upper() == b"CLUSTER" else _bulk(self.name))
        writer.close()


@pytest.fixture
async def nodes() -> AsyncIterator[tuple[FakeNode, FakeNode]]:
    ports: list[int] = []
    a, b = FakeNode(b"a", ports), FakeNode(b"b", ports)
    servers = [await asyncio.start_server(node.serve, "127.0.0.1", 0) for node in (a, b)]
    for node, server in zip((a, b), servers, strict=True):
        node.port = server.sockets[0].getsockname()[1]
        ports.append(node.port)
    yield a, b
    for server in servers:
        server.close()


def _key_on(first_half: bool) -> str:
    """A key whose slot the first node (or the second) serves."""
    n = 0
    while (key_slot(f"{{t{n}}}:h") < SLOTS // 2) != first_half:
        n += 1
    return f"{{t{n}}}:h"


async def test_a_black_holed_master_is_skipped_alone(nodes: tuple[FakeNode, FakeNode]) -> None:
    a, b = nodes
    on_a, on_b = _key_on(True), _key_on(False)
    client = ClusterClient(f"redis://127.0.0.1:{a.port}", timeout_s=0.2, breakers=lambda: RedisBreaker(0.5, 1.0))
    try:
        assert await client.execute("GET", on_a) == b"a"
        assert await client.execute("GET", on_b) == b"b"

        b.hung = True
        with pytest.raises(RedisTimeout):
            await client.execute("GET", on_b)
        started = time.monotonic()
        for _ in range(10):
            # The other master serves its slots: one breaker for the cluster would have skipped it too.
            assert await client.execute("GET", on_a) == b"a"
            # The black-holed one costs no second timeout during its pause.
            with pytest.raises(RedisSkipped):
                await client.execute("GET", on_b)
        assert time.monotonic() - started < 0.15
        # A pipeline spanning both is failed by the skipped node's part alone, at once.
        with pytest.raises(RedisSkipped):
            await client.pipeline([("GET", on_a), ("GET", on_b)])
        asked_of_b = len(b.asked)

        b.hung = False
        await asyncio.sleep(0.55)
        # After the pause one command probes the node, and its answer ends the pause.
        assert await client.execute("GET", on_b) == b"b"
        assert await client.execute("GET", on_b) == b"b"
        assert len(b.asked) == asked_of_b + 2
    finally:
        await client.aclose()


async def test_a_whole_cluster_black_holed_costs_one_timeout_per_node_and_pause(
    nodes: tuple[FakeNode, FakeNode],
) -> None:
    a, b = nodes
    on_a, on_b = _key_on(True), _key_on(False)
    client = ClusterClient(f"redis://127.0.0.1:{a.port}", timeout_s=0.2, breakers=lambda: RedisBreaker(5.0, 10.0))
    try:
        assert await client.execute("GET", on_a) == b"a"
        assert await client.execute("GET", on_b) == b"b"
        a.hung = b.hung = True
        started = time.monotonic()
        for key in (on_a, on_b) * 10:
            with pytest.raises(OSError):  # a timeout, then skipped (a node's, or the slot map's read)
                await client.execute("GET", key)
        # One timeout per node (the second's on reading the slot map again, which the first let go of), then every
        # call is skipped: no node is asked again during its pause.
        assert time.monotonic() - started < 2 * 0.2 + 0.4
    finally:
        await client.aclose()
