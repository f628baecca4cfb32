"""statestore's own Redis client on a real Redis Cluster (store/resp_cluster.py): each command reaches the node of its
key's slot, a pipeline spread over nodes answers in order, a script is loaded again on the node that lost it, a slot
moved half-way (ASK) and for good (MOVED) is followed, a master killed is replaced by its replica, which the client
finds by reading the slot map again, and background events are kept on the node of their stream."""

from __future__ import annotations

import asyncio
import signal
import uuid
from collections.abc import AsyncIterator

import pytest

from statestore.store.event_log import Event, RedisEventLog, Superseded
from statestore.store.resp import RedisBreaker, Script
from statestore.store.resp_cluster import ClusterClient, key_slot, redis_client
from statestore.store.resp_reader import RedisConnectionError
from tests.scaleout.processes import RedisClusterProcesses, RedisNode, command, wait_for

_ECHO_KEY = Script("return redis.call('GET', KEYS[1])")


@pytest.fixture
async def client(redis_cluster: RedisClusterProcesses) -> AsyncIterator[ClusterClient]:
    # The breaker off: a test's failures are its own to see, not skipped for a pause.
    cluster = ClusterClient(redis_cluster.url.replace("?cluster=1", ""), breakers=lambda: RedisBreaker(0.0, 0.0))
    yield cluster
    await cluster.aclose()


def _node_id(node: RedisNode) -> str:
    with node.client() as raw:
        return str(command(raw, "CLUSTER", "MYID").decode())


def test_slots_are_the_clusters_own() -> None:
    """CRC16 of the key or of its hash tag, as CLUSTER KEYSLOT answers (held against fixed answers of Redis 7)."""
    assert key_slot("foo") == 12182
    assert key_slot("{user1000}.following") == key_slot("user1000") == 3443
    assert key_slot("foo{}{bar}") == key_slot("foo{}{bar}")  # an empty tag: the whole key
    assert key_slot("foo{}{bar}") == 8363
    assert key_slot("foo{{bar}}zap") == key_slot("{bar") == 4015
    assert key_slot(b"sstest:{thread_1}:h") == key_slot("thread_1")


async def test_each_command_reaches_the_node_of_its_slot(
    client: ClusterClient, redis_cluster: RedisClusterProcesses
) -> None:
    prefix = f"sstest:{uuid.uuid4().hex}:"
    keys = [f"{prefix}{{t{i}}}:h" for i in range(60)]
    await asyncio.gather(*(client.execute("SET", key, key) for key in keys))
    nodes = set()
    for key in keys:
        assert key_slot(key) == redis_cluster.keyslot(key)
        owner = redis_cluster.node_of_slot(key_slot(key))
        nodes.add(owner.port)
        with owner.client() as raw:
            assert raw.get(key) == key.encode()
    assert len(nodes) == 3
    # One pipeline across the three nodes: each reply in its command's place.
    replies = await client.pipeline([("GET", key) for key in keys])
    assert replies == [key.encode() for key in keys]
    assert await client.execute("PING") == b"PONG"
    await client.pipeline([("DEL", key) for key in keys], probe=True)
    assert await client.pipeline([("EXISTS", key) for key in keys]) == [0] * len(keys)


async def test_a_script_is_loaded_again_on_the_node_that_lost_it(
    client: ClusterClient, redis_cluster: RedisClusterProcesses
) -> None:
    key = f"sstest:{uuid.uuid4().hex}:{{thread}}:h"
    await client.execute("SET", key, b"kept")
    assert await _ECHO_KEY.run(client, [key], []) == b"kept"
    with redis_cluster.node_of_slot(key_slot(key)).client() as raw:
        command(raw, "SCRIPT", "FLUSH")
    assert await _ECHO_KEY.run(client, [key], []) == b"kept"
    await client.execute("DEL", key)


async def test_a_slot_moved_half_way_then_for_good_is_followed(
    client: ClusterClient, redis_cluster: RedisClusterProcesses
) -> None:
    """ASK while the slot migrates (a key not on its old node yet is asked of the new one), MOVED once it has: the
    client follows both, and reads the slot map again after a MOVED."""
    tag = uuid.uuid4().hex
    kept, new = f"sstest:{{{tag}}}:kept", f"sstest:{{{tag}}}:new"
    slot = key_slot(kept)
    await client.execute("SET", kept, b"before")
    source = redis_cluster.node_of_slot(slot)
    target = next(node for node in redis_cluster.nodes if node is not source)
    source_id, target_id = _node_id(source), _node_id(target)
    with target.client() as raw:
        command(raw, "CLUSTER", "SETSLOT", str(slot), "IMPORTING", source_id)
    with source.client() as raw:
        command(raw, "CLUSTER", "SETSLOT", str(slot), "MIGRATING", target_id)

    await client.execute("SET", new, b"asked")  # not on the source: ASK, then ASKING on the target
    assert await client.execute("GET", kept) == b"before"  # still on the source
    with target.client() as raw:
        assert new.encode() in command(raw, "CLUSTER", "GETKEYSINSLOT", str(slot), "10")

    with source.client() as raw:
        command(raw, "MIGRATE", "127.0.0.1", str(target.port), "", "0", "5000", "KEYS", kept)
    for node in redis_cluster.nodes:
        with node.client() as raw:
            command(raw, "CLUSTER", "SETSLOT", str(slot), "NODE", target_id)
    assert client._slots is not None and client._slots[slot] == ("127.0.0.1", source.port)

    assert await client.execute("GET", kept) == b"before"  # MOVED to the target
    assert await client.pipeline([("GET", new), ("GET", kept)]) == [b"asked", b"before"]
    await asyncio.sleep(0.2)  # the map read again in the background
    assert client._slots is not None and client._slots[slot] == ("127.0.0.1", target.port)
    await client.execute("DEL", kept, new)


async def test_a_follower_blocks_on_a_connection_of_its_own(client: ClusterClient) -> None:
    """XREAD BLOCK on the stream's node while commands to that node go on answering."""
    stream = f"sstest:bg:{{{uuid.uuid4().hex}}}:events"
    waiting = asyncio.ensure_future(
        client.blocking("XREAD", "COUNT", 10, "BLOCK", 3000, "STREAMS", stream, "0-1", wait_s=3.0)
    )
    await asyncio.sleep(0.2)
    assert await client.execute("XADD", stream, "0-2", "f", "x") == b"0-2"
    (reply,) = await waiting
    assert reply[0] == stream.encode() and reply[1][0][0] == b"0-2"
    await client.execute("DEL", stream)


async def test_a_master_killed_is_replaced_by_its_replica(redis_cluster_with_replica: RedisClusterProcesses) -> None:
    """A master's slots fail as an outage while it is gone (the map is to be read again), then reach the replica the
    cluster promoted in its place."""
    cluster = redis_cluster_with_replica
    client = ClusterClient(cluster.url.replace("?cluster=1", ""), breakers=lambda: RedisBreaker(0.0, 0.0))
    try:
        master = cluster.nodes[1]
        key = next(f"sstest:{{t{i}}}:h" for i in range(1000) if cluster.node_of_slot(key_slot(f"t{i}")) is master)
        await client.execute("SET", key, b"replicated")
        with master.client() as raw:
            command(raw, "WAIT", "1", "2000")
        master.process.send_signal(signal.SIGKILL)
        master.process.wait()
        with pytest.raises(RedisConnectionError):
            await client.execute("GET", key)
        assert client._slots is None
        replica = cluster.nodes[-1]
        wait_for("the replica promoted", lambda: _is_master(replica), timeout=30)

        async def served() -> bytes | None:
            for _ in range(100):
                try:
                    found: bytes | None = await client.execute("GET", key)
                    return found
                except RedisConnectionError:
                    await asyncio.sleep(0.2)
            return None

        assert await served() == b"replicated"
        assert client._slots is not None
        assert client._slots[key_slot(key)] == ("127.0.0.1", replica.port)
    finally:
        await client.aclose()


def _is_master(node: RedisNode) -> bool:
    with node.client() as raw:
        info = raw.info("replication")  # parsed by redis-py
    return bool(info.get("role") == "master")


async def test_background_events_on_the_cluster(redis_cluster: RedisClusterProcesses) -> None:
    """The event log's publish script, reads and a follower's wait, on the node of the response's stream."""
    client = redis_client(redis_cluster.url)
    events = RedisEventLog(client, f"sstest:{uuid.uuid4().hex}:", cap=100)
    try:
        await events.publish("resp_a", 1, [Event(0, b"zero"), Event(1, b"one")], 10_000)
        waiting = asyncio.ensure_future(events.read("resp_a", 1, block_ms=3000))
        await asyncio.sleep(0.2)
        await events.publish("resp_a", 1, [Event(2, b"two", final=True)], 10_000)
        assert [(e.seq, e.frame, e.final) for e in await waiting] == [(2, b"two", True)]
        assert [e.frame for e in await events.read("resp_a", -1, block_ms=0)] == [b"zero", b"one", b"two"]
        assert await events.last("resp_a") == (2, 1)
        with pytest.raises(Superseded):
            await events.publish("resp_a", 0, [Event(3, b"late")], 10_000)
    finally:
        await client.aclose()
