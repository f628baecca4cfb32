"""Threads across replicas: three statestore processes on one PostgreSQL database behind HAProxy (round robin, no
stickiness) with a Redis Cluster of three masters. The SDK's thread helper talks to HAProxy only.

One scenario runs once for the module (twelve conversations of four turns, the third streamed, one conversation's
cache entry dropped mid-way) and again, for reference, against a single statestore node on standalone Redis; the
tests below each check one property of what happened.
"""

from __future__ import annotations

import itertools
import re
import secrets
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
import redis

from statestore.store.cache_entry import decode_count
from tests.conftest import migrated_scratch_pg_database
from tests.scaleout.clients import MODEL, RecordingClient, Seen, ThreadApi, message_text, new_api_key, user
from tests.scaleout.conftest import Fleet, fleet_factory
from tests.scaleout.processes import RedisClusterProcesses, wait_for
from tests.support.fake_backend import FakeBackend
from tests.support.server import StatestoreServer

CONVERSATIONS = 12  # enough that the threads' slots fall on at least two of three masters (all on one: 3**-11)
TURNS = 4
STREAMED_TURN = 3
EVICTED_CONVERSATION = 0  # its cache entry is deleted after turn 2, so turn 3 is rebuilt from PostgreSQL
SYSTEM = [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]
TOOLS = [
    {
        "name": "lookup",
        "description": "Look a word up.",
        "input_schema": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
    }
]


@dataclass
class Conversation:
    index: int
    thread_id: str
    turns: list[Seen]  # the SDK's responses to POST /v1/messages, retries included
    history: list[tuple[str, str]]  # (role, text) of every message, as the SDK's thread holds them
    head_message_id: str


@dataclass
class Scenario:
    fleet: Fleet
    cluster: RedisClusterProcesses
    conversations: list[Conversation]
    fleet_bodies: list[bytes]  # what the backend received through the fleet, in order
    single_node_bodies: list[bytes]  # the same conversations against one statestore node
    owners: dict[int, str]


def converse(base_url: str, index: int, api_key: str, *, evict: Callable[[str], None] | None = None) -> Conversation:
    with RecordingClient(base_url, api_key) as client:
        thread = client.sdk.beta.messages.thread(
            model=MODEL,
            max_tokens=256,
            system=SYSTEM,  # type: ignore[arg-type]
            tools=TOOLS,  # type: ignore[arg-type]
        )
        for turn in range(1, TURNS + 1):
            text = f"conversation {index}, turn {turn}"
            if turn == STREAMED_TURN:
                with thread.stream(user(text)) as stream:
                    stream.get_final_message()
            else:
                thread.send(user(text))
            if evict is not None and turn == 2:
                thread_id = client.turns()[-1].thread_id
                assert thread_id is not None
                evict(thread_id)
        turns = client.turns()
        thread_id = turns[0].thread_id
        assert thread_id is not None
        head = thread.previous_message_id
        assert head is not None
        return Conversation(index, thread_id, turns, [message_text(m) for m in thread.messages], head)


def keys_of(prefix: str, thread_id: str) -> tuple[str, str]:
    """The two keys statestore keeps per thread (statestore/store/redis_cache.py), under one hash tag."""
    return f"{prefix}{{{thread_id}}}:h", f"{prefix}{{{thread_id}}}:n"


@pytest.fixture(scope="module")
async def routing_database(postgres_admin_url: str) -> AsyncIterator[str]:
    async with migrated_scratch_pg_database(postgres_admin_url) as url:
        yield url


@pytest.fixture(scope="module")
def scenario(
    routing_database: str,
    redis_url: str,
    redis_cluster: RedisClusterProcesses,
    scaleout_backend: FakeBackend,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Scenario]:
    workdir = tmp_path_factory.mktemp("routing")
    with fleet_factory(redis_cluster, scaleout_backend, workdir) as start_fleet:
        fleet = start_fleet(routing_database)
        cluster_client = redis_cluster.client()

        def evict(thread_id: str) -> None:
            assert cluster_client.delete(*keys_of(fleet.redis_prefix, thread_id)) == 2

        scaleout_backend.reset()
        owners = {index: new_api_key(f"c{index}") for index in range(CONVERSATIONS)}
        conversations = [
            converse(fleet.url, index, owners[index], evict=evict if index == EVICTED_CONVERSATION else None)
            for index in range(CONVERSATIONS)
        ]
        fleet_bodies = [request.body for request in scaleout_backend.requests()]
        cluster_client.close()

        scaleout_backend.reset()
        single_prefix = f"sstest:{secrets.token_hex(6)}:"
        single = StatestoreServer(
            database_url=routing_database,
            upstream_url=scaleout_backend.url,
            redis_url=redis_url,
            redis_prefix=single_prefix,
            log_path=workdir / "single-node.log",
        )
        try:
            for index in range(CONVERSATIONS):
                converse(single.url, index, new_api_key(f"single{index}"))
        finally:
            single.stop()
            with redis.Redis.from_url(redis_url) as standalone:
                for key in standalone.scan_iter(match=single_prefix + "*", count=1000):
                    standalone.delete(key)
        single_node_bodies = [request.body for request in scaleout_backend.requests()]
        yield Scenario(fleet, redis_cluster, conversations, fleet_bodies, single_node_bodies, owners)


def test_every_turn_was_one_request_on_one_thread(scenario: Scenario) -> None:
    for conversation in scenario.conversations:
        statuses = [seen.status for seen in conversation.turns]
        assert statuses == [200] * TURNS, f"conversation {conversation.index}: {conversation.turns}"
        # No replay under a new thread: every replica found the thread the others had stored.
        assert {seen.thread_id for seen in conversation.turns} == {conversation.thread_id}


def test_consecutive_turns_of_a_thread_land_on_different_replicas(scenario: Scenario) -> None:
    replicas_used: set[str] = set()
    for conversation in scenario.conversations:
        replicas = [seen.replica for seen in conversation.turns]
        assert None not in replicas
        replicas_used.update(r for r in replicas if r is not None)
        moves = sum(1 for before, after in itertools.pairwise(replicas) if before != after)
        assert moves >= 1, f"conversation {conversation.index} stayed on one replica: {replicas}"
        assert len(set(replicas)) >= 2
    assert replicas_used == {r.name for r in scenario.fleet.replicas}


_HAPROXY_LINE = re.compile(
    r'statestore/(?P<server>\S+) (?P<status>\d{3}) \S+ \d+ "POST /v1/messages [^"]*" thread=\{(?P<thread>[^}]*)\}'
)


def test_haproxy_log_shows_each_thread_served_by_several_replicas(scenario: Scenario) -> None:
    def servers_by_thread() -> dict[str, set[str]]:
        found: dict[str, set[str]] = defaultdict(set)
        for line in scenario.fleet.haproxy.log_lines():
            match = _HAPROXY_LINE.search(line)
            if match and match["status"] == "200":
                found[match["thread"]].add(match["server"])
        return found

    wanted = {c.thread_id for c in scenario.conversations}
    wait_for("haproxy's log lines", lambda: wanted <= servers_by_thread().keys(), timeout=5)
    by_thread = servers_by_thread()
    for conversation in scenario.conversations:
        assert len(by_thread[conversation.thread_id]) >= 2, by_thread[conversation.thread_id]


def test_each_replica_access_log_has_thread_turns(scenario: Scenario) -> None:
    for replica in scenario.fleet.replicas:
        turns = []
        for line in replica.log_lines():
            if '"statestore.access"' in line:
                entry = orjson.loads(line)
                if entry.get("route") == "/v1/messages" and entry.get("status") == 200:
                    turns.append(entry)
        assert turns, f"replica {replica.name} served no turn:\n{replica.log()[-2000:]}"


def test_all_keys_of_a_thread_hash_to_one_slot_on_its_node(scenario: Scenario) -> None:
    cluster = scenario.cluster
    for conversation in scenario.conversations:
        history_key, count_key = keys_of(scenario.fleet.redis_prefix, conversation.thread_id)
        slot = cluster.keyslot(history_key)
        assert cluster.keyslot(count_key) == slot
        # The hash tag is the thread id: the slot is the thread id's own.
        assert cluster.keyslot(conversation.thread_id) == slot
        with cluster.node_of_slot(slot).client() as owner:
            assert owner.exists(history_key, count_key) == 2, "the keys live on the master serving their slot"
            assert decode_count(owner.get(count_key) or b"0") == (2 * TURNS, None)


def test_threads_spread_over_slots_and_nodes(scenario: Scenario) -> None:
    slots = {
        scenario.cluster.keyslot(keys_of(scenario.fleet.redis_prefix, c.thread_id)[0]) for c in scenario.conversations
    }
    nodes = {scenario.cluster.node_of_slot(slot).port for slot in slots}
    assert len(slots) >= CONVERSATIONS - 2, slots
    assert len(nodes) >= 2, f"all {CONVERSATIONS} threads on one master: slots {slots}"


def test_rebuilt_requests_are_byte_identical_to_a_single_node(scenario: Scenario) -> None:
    assert len(scenario.fleet_bodies) == CONVERSATIONS * TURNS
    assert len(scenario.single_node_bodies) == len(scenario.fleet_bodies)
    for number, (fleet_body, single_body) in enumerate(
        zip(scenario.fleet_bodies, scenario.single_node_bodies, strict=True)
    ):
        assert fleet_body == single_body, f"request {number} differs:\n{fleet_body!r}\n{single_body!r}"


def test_every_rebuilt_request_carries_the_full_history(scenario: Scenario) -> None:
    bodies = iter(scenario.fleet_bodies)
    for conversation in scenario.conversations:
        for turn in range(1, TURNS + 1):
            body: dict[str, Any] = orjson.loads(next(bodies))
            assert "thread" not in body
            assert body["system"] == SYSTEM
            assert body["tools"] == TOOLS
            assert body.get("stream", False) is (turn == STREAMED_TURN)
            expected = conversation.history[: 2 * turn - 1]
            # Earlier turns' block cache_control markers are dropped; none were set on messages here.
            assert [message_text(m) for m in body["messages"]] == expected


def test_thread_api_agrees_from_every_replica(scenario: Scenario) -> None:
    for conversation in scenario.conversations[:3]:
        for replica in scenario.fleet.replicas:
            with ThreadApi(replica.url, scenario.owners[conversation.index]) as api:
                info = api.thread(conversation.thread_id)
                assert info["message_count"] == 2 * TURNS
                assert info["head_message_id"] == conversation.head_message_id
                exported = api.export(conversation.thread_id)
                assert [message_text(m) for m in exported["messages"]] == conversation.history


def test_the_balancer_has_no_stickiness(scenario: Scenario) -> None:
    directives = [line.split()[0] for line in scenario.fleet.haproxy.config_path.read_text().splitlines()
                  if line.strip() and not line.lstrip().startswith("#")]  # fmt: skip
    assert "balance roundrobin" in scenario.fleet.haproxy.config_path.read_text()
    assert not {"cookie", "stick", "stick-table", "hash-type", "hash-balance-factor"} & set(directives)
    assert "option prefer-last-server" not in scenario.fleet.haproxy.config_path.read_text()


def test_deleting_a_thread_erases_its_keys_on_its_node(scenario: Scenario) -> None:
    api_key = new_api_key("erase")
    with RecordingClient(scenario.fleet.url, api_key) as client, ThreadApi(scenario.fleet.url, api_key) as api:
        thread = client.sdk.beta.messages.thread(model=MODEL, max_tokens=64)
        thread.send(user("one"))
        thread.send(user("two"))
        thread_id = client.turns()[-1].thread_id
        assert thread_id is not None
        keys = keys_of(scenario.fleet.redis_prefix, thread_id)
        node = scenario.cluster.node_of_slot(scenario.cluster.keyslot(keys[0]))
        with node.client() as owner:
            assert owner.exists(*keys) == 2
            deleted = api.http.delete(f"/statestore/v1/threads/{thread_id}")
            assert deleted.status_code == 200, deleted.text
            assert owner.exists(*keys) == 0
        assert api.http.get(f"/statestore/v1/threads/{thread_id}").status_code == 404
