"""Background responses on real processes (docs/responses.md, "Background responses"): two replicas of
statestore on one PostgreSQL database and one Redis prefix, the `openai` SDK as the client. A turn created on one
replica is polled, resumed and cancelled on the other; a replica killed mid-turn leaves nothing stuck."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, cast

import httpx
import openai
import orjson
import pytest
import redis
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from statestore.store.event_log import Event, EventLogUnavailable, RedisEventLog, Superseded
from statestore.store.resp import RespClient
from statestore.store.resp_cluster import redis_client
from tests.integration.responses.conftest import ADMIN_TOKEN
from tests.support.fake_backend import FakeBackend
from tests.support.redis_keys import own_redis_prefix
from tests.support.server import StatestoreServer

CHAT = "/v1/chat/completions"
LEASE = "3"  # seconds: a killed replica's turns are claimed by another within this


def replica(url: str, backend: FakeBackend, redis_url: str, prefix: str, **settings: str) -> StatestoreServer:
    return StatestoreServer(
        database_url=url,
        upstream_url=backend.url,
        redis_url=redis_url,
        redis_prefix=prefix,
        env={
            "STATESTORE_CHAT_UPSTREAM_URL": backend.url,
            "STATESTORE_ADMIN_TOKENS": f"ops:{ADMIN_TOKEN}",
            "STATESTORE_LEASE_SECONDS": LEASE,
            "STATESTORE_BACKGROUND_POLL_SECONDS": "0.2",
            **{f"STATESTORE_{name.upper()}": value for name, value in settings.items()},
        },
    )


@pytest.fixture(scope="module")
async def background_db(postgres_admin_url: str) -> AsyncIterator[str]:
    from tests.conftest import migrated_scratch_pg_database

    async with migrated_scratch_pg_database(postgres_admin_url) as url:
        yield url


@pytest.fixture(scope="module")
def prefix(redis_url: str) -> Iterator[str]:
    with own_redis_prefix(redis_url) as own:
        yield own


@pytest.fixture(scope="module")
def pair(
    background_db: str, fake_backend_process: FakeBackend, redis_url: str, prefix: str
) -> Iterator[tuple[StatestoreServer, StatestoreServer]]:
    first = replica(background_db, fake_backend_process, redis_url, prefix)
    second = replica(background_db, fake_backend_process, redis_url, prefix)
    yield first, second
    first.stop()
    second.stop()


@pytest.fixture
def clients(
    pair: tuple[StatestoreServer, StatestoreServer], api_key: str
) -> Iterator[tuple[openai.OpenAI, openai.OpenAI]]:
    with (
        openai.OpenAI(base_url=pair[0].url + "/v1", api_key=api_key, max_retries=0) as a,
        openai.OpenAI(base_url=pair[1].url + "/v1", api_key=api_key, max_retries=0) as b,
    ):
        yield a, b


def wait_for(check: Callable[[], Any], *, seconds: float = 15.0, every: float = 0.05) -> Any:
    deadline = time.monotonic() + seconds
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(every)


def final(client: openai.OpenAI, response_id: str, seconds: float = 15.0) -> Any:
    return wait_for(
        lambda: (r := client.responses.retrieve(response_id)).status not in ("queued", "in_progress") and r,
        seconds=seconds,
    )


def stall(backend: FakeBackend, seconds: float, events: int = 3) -> None:
    backend.script({"kind": "echo", "path": CHAT, "stall_after_events": events, "stall_seconds": seconds})


def streamed_until(client: openai.OpenAI, text: str, event_type: str) -> list[Any]:
    """A streamed background turn's events up to the first `event_type`, where the client then goes away."""
    seen: list[Any] = []
    with client.responses.create(model="echo-1", input=text, background=True, stream=True) as stream:
        for event in stream:
            seen.append(event)
            if event.type == event_type:
                break
    return seen


def raw_events(base: str, api_key: str, response_id: str, after: int | None) -> Iterator[dict[str, Any]]:
    """The resumed stream as sent: every event, parsed, in order."""
    params: dict[str, Any] = {"stream": "true"}
    if after is not None:
        params["starting_after"] = after
    headers = {"authorization": f"Bearer {api_key}"}
    with httpx.stream("GET", f"{base}/v1/responses/{response_id}", params=params, headers=headers, timeout=30) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                yield orjson.loads(line[6:])


def test_a_background_turn_is_polled_to_completion_on_the_other_replica(
    clients: tuple[openai.OpenAI, openai.OpenAI], backend: FakeBackend
) -> None:
    a, b = clients
    queued = a.responses.create(model="echo-1", input="hello in the background", background=True)
    assert queued.status == "queued" and queued.background is True and queued.output == []
    done = final(b, queued.id)
    assert done.status == "completed" and done.output_text == "echo: hello in the background"
    assert done.background is True
    # a completed background response is a stored response: continued like any other, from either replica
    following = b.responses.create(model="echo-1", input="and then", previous_response_id=done.id)
    assert following.output_text == "echo: and then"
    sent = backend.requests()[-1].json()
    assert [m["content"] for m in sent["messages"]] == ["hello in the background", done.output_text, "and then"]


def test_a_background_stream_cut_short_resumes_on_the_other_replica_exactly(
    clients: tuple[openai.OpenAI, openai.OpenAI],
    pair: tuple[StatestoreServer, StatestoreServer],
    api_key: str,
    backend: FakeBackend,
) -> None:
    a, _ = clients
    stall(backend, 1.0, events=2)
    seen = streamed_until(a, "one two three four five", "response.output_text.delta")  # the connection drops mid-reply
    assert [e.type for e in seen[:2]] == ["response.created", "response.queued"]
    response_id = seen[0].response.id
    last = seen[-1].sequence_number
    rest = list(raw_events(pair[1].url, api_key, response_id, last))
    numbers = [e.sequence_number for e in seen] + [e["sequence_number"] for e in rest]
    assert numbers == list(range(len(numbers)))  # nothing twice, nothing missing
    assert rest[-1]["type"] == "response.completed"
    text = "".join(e.delta for e in seen if e.type == "response.output_text.delta") + "".join(
        e["delta"] for e in rest if e["type"] == "response.output_text.delta"
    )
    assert text == "echo: one two three four five"
    assert rest[-1]["response"]["output"][0]["content"][0]["text"] == text
    # the whole stream again from the start, from storage or the event log alike
    again = list(raw_events(pair[0].url, api_key, response_id, None))
    assert again[0]["type"] == "response.created" and again[-1]["type"] == "response.completed"


def test_cancel_a_running_turn_from_the_other_replica(
    clients: tuple[openai.OpenAI, openai.OpenAI], backend: FakeBackend
) -> None:
    a, b = clients
    conversation = a.conversations.create(items=[{"role": "user", "content": "before"}])
    stall(backend, 20.0, events=2)
    queued = a.responses.create(model="echo-1", input="a long one", background=True, conversation=conversation.id)
    wait_for(lambda: b.responses.retrieve(queued.id).status == "in_progress")
    started = time.monotonic()
    cancelled = b.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    assert time.monotonic() - started < 1.5
    assert a.responses.retrieve(queued.id).status == "cancelled"
    # nothing of it reached the conversation, which is free again
    items = a.conversations.items.list(conversation.id, order="asc")
    assert [item.model_dump()["content"][0]["text"] for item in items.data] == ["before"]
    after = a.responses.create(model="echo-1", input="next", conversation=conversation.id)
    assert after.output_text == "echo: next"
    # cancelling again returns it as it is; cancelling a foreground response is refused
    assert a.responses.cancel(queued.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        a.responses.cancel(after.id)


def test_a_conversation_is_held_by_its_background_turn(
    clients: tuple[openai.OpenAI, openai.OpenAI], backend: FakeBackend
) -> None:
    a, b = clients
    conversation = a.conversations.create()
    stall(backend, 1.5, events=2)
    queued = a.responses.create(model="echo-1", input="first", background=True, conversation=conversation.id)
    wait_for(lambda: b.responses.retrieve(queued.id).status == "in_progress")
    with pytest.raises(openai.BadRequestError) as refused:
        b.responses.create(model="echo-1", input="second", conversation=conversation.id)
    assert refused.value.code == "conversation_locked"
    assert final(b, queued.id).status == "completed"
    items = b.conversations.items.list(conversation.id, order="asc")
    assert [item.type for item in items.data] == ["message", "message"]


def test_requests_background_cannot_serve(clients: tuple[openai.OpenAI, openai.OpenAI]) -> None:
    a, _ = clients
    with pytest.raises(openai.BadRequestError) as unstored:
        a.responses.create(model="echo-1", input="x", background=True, store=False)
    assert unstored.value.param == "background"
    foreground = a.responses.create(model="echo-1", input="plain")
    with pytest.raises(openai.BadRequestError):
        list(a.responses.retrieve(foreground.id, stream=True))
    with pytest.raises(openai.NotFoundError):
        a.responses.cancel("resp_" + "x" * 40)
    with pytest.raises(openai.BadRequestError) as unknown:
        a.responses.create(model="echo-1", input="x", background=True, previous_response_id="resp_" + "y" * 40)
    assert unknown.value.code == "previous_response_not_found"


def test_events_gone_from_redis_mid_stream_end_from_storage(
    clients: tuple[openai.OpenAI, openai.OpenAI],
    pair: tuple[StatestoreServer, StatestoreServer],
    api_key: str,
    backend: FakeBackend,
    redis_url: str,
    prefix: str,
) -> None:
    a, _ = clients
    stall(backend, 1.0, events=2)
    queued = a.responses.create(model="echo-1", input="flushed away", background=True)
    stream = raw_events(pair[1].url, api_key, queued.id, None)
    first = [next(stream) for _ in range(3)]
    assert [e["type"] for e in first] == ["response.created", "response.queued", "response.in_progress"]
    # everything this test's replicas keep in Redis goes (as a flush would take it)
    store = redis.Redis.from_url(redis_url)
    for key in store.scan_iter(match=f"{prefix}*"):
        store.delete(key)
    rest = list(stream)
    assert rest[-1]["type"] == "response.completed"
    assert rest[-1]["response"]["output"][0]["content"][0]["text"] == "echo: flushed away"
    numbers = [e["sequence_number"] for e in first + rest]
    assert numbers == sorted(set(numbers))
    assert final(a, queued.id).output_text == "echo: flushed away"


def test_events_lost_midway_are_never_spliced_into_a_replay(
    clients: tuple[openai.OpenAI, openai.OpenAI],
    pair: tuple[StatestoreServer, StatestoreServer],
    api_key: str,
    redis_url: str,
    prefix: str,
) -> None:
    """Found by the fault campaign: a batch of a run's events lost (a Redis connection reset), the later ones kept. A
    client that had seen only the queued events was told the rest from storage, numbered as a replay numbers them;
    resumed later, it was given the run's own later events on top, and read the reply twice."""
    a, _ = clients
    queued = a.responses.create(model="echo-1", input="a batch lost in the middle", background=True)
    done = final(a, queued.id)
    store = redis.Redis.from_url(redis_url)
    # sequence numbers 2 to 4 (stream ids are the number plus one): in_progress and the reply's first events
    assert store.xdel(f"{prefix}bg:{{{queued.id}}}:events", "0-3", "0-4", "0-5") == 3
    seen: list[dict[str, Any]] = []
    for event in raw_events(pair[1].url, api_key, queued.id, 1):
        seen.append(event)
        if len(seen) == 3:
            break  # the connection drops
    if seen[-1]["type"] != "response.completed":
        seen += raw_events(pair[0].url, api_key, queued.id, seen[-1]["sequence_number"])
    numbers = [e["sequence_number"] for e in seen]
    assert numbers == list(range(2, 2 + len(numbers)))
    assert [e["type"] for e in seen if e["type"].startswith("response.") and "response" in e] == ["response.completed"]
    deltas = "".join(e["delta"] for e in seen if e["type"] == "response.output_text.delta")
    assert done.output_text.startswith(deltas)  # told once at most, never twice
    assert seen[-1]["response"]["output"][0]["content"][0]["text"] == done.output_text


@pytest.fixture
async def own_db(postgres_admin_url: str) -> AsyncIterator[str]:
    from tests.conftest import migrated_scratch_pg_database

    async with migrated_scratch_pg_database(postgres_admin_url) as url:
        yield url


@pytest.fixture
def own_db_replicas(
    own_db: str, fake_backend_process: FakeBackend, redis_url: str
) -> Iterator[Callable[..., StatestoreServer]]:
    """Replicas on a database and prefix of this test's own (killed, or with settings of their own)."""
    started: list[StatestoreServer] = []
    with own_redis_prefix(redis_url) as own:

        def start(**settings: str) -> StatestoreServer:
            server = replica(own_db, fake_backend_process, redis_url, own, **settings)
            started.append(server)
            return server

        yield start
        for server in started:
            server.stop()


def test_a_replica_killed_mid_turn_leaves_nothing_stuck(
    own_db_replicas: Callable[..., StatestoreServer], backend: FakeBackend, api_key: str
) -> None:
    doomed = own_db_replicas(background_workers="2")
    survivor = own_db_replicas()
    with (
        openai.OpenAI(base_url=doomed.url + "/v1", api_key=api_key, max_retries=0) as a,
        openai.OpenAI(base_url=survivor.url + "/v1", api_key=api_key, max_retries=0) as b,
    ):
        conversation = a.conversations.create()
        # a streamed turn publishes its events as they come: cut off after some of them
        stall(backend, 30.0, events=2)
        seen = streamed_until(a, "cut off", "response.output_text.delta")
        streamed_id = seen[0].response.id
        # a turn asked for as JSON publishes its events once it is stored: cut off before any
        stall(backend, 30.0, events=0)
        whole = a.responses.create(model="echo-1", input="run again", background=True)
        wait_for(lambda: b.responses.retrieve(whole.id).status == "in_progress")
        # both workers are busy: a turn on a conversation waits queued on this replica, holding the conversation
        waiting = a.responses.create(
            model="echo-1", input="after the crash", background=True, conversation=conversation.id
        )
        assert b.responses.retrieve(waiting.id).status == "queued"
        os.kill(doomed.process.pid, signal.SIGKILL)
        doomed.process.wait()
        # the streamed one had published events of its own: it ends failed, never stuck and never run twice
        failed = final(b, streamed_id, seconds=20)
        assert failed.status == "failed" and failed.error is not None and failed.error.code == "server_error"
        events = list(raw_events(survivor.url, api_key, streamed_id, None))
        assert events[-1]["type"] == "response.failed"
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert "response.output_text.delta" in {e["type"] for e in events}
        # the JSON one had published nothing beyond its queueing: it runs again, whole, once
        rerun = final(b, whole.id, seconds=20)
        assert rerun.status == "completed" and rerun.output_text == "echo: run again"
        events = list(raw_events(survivor.url, api_key, whole.id, None))
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert events[-1]["type"] == "response.completed"
        # the queued one runs on the survivor
        done = final(b, waiting.id, seconds=20)
        assert done.status == "completed" and done.output_text == "echo: after the crash"
        items = b.conversations.items.list(conversation.id, order="asc")
        assert len(items.data) == 2
        sent = [r.json()["messages"][-1]["content"] for r in backend.requests() if r.path == CHAT]
        # the streamed one was never sent again, the JSON one once more
        assert (sent.count("cut off"), sent.count("run again"), sent.count("after the crash")) == (1, 2, 1)


def test_cancel_a_queued_turn_from_another_replica_and_the_owners_bound(
    own_db_replicas: Callable[..., StatestoreServer], api_key: str
) -> None:
    # replicas that run no background turns themselves: what they admit stays queued
    first = own_db_replicas(background_workers="0")
    second = own_db_replicas(background_workers="0")
    admin = httpx.Client(base_url=first.url, headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
    policy = admin.get("/admin/v1/policies/default").json()["policy"]
    assert policy["max_background_turns"] == 16
    put = admin.put("/admin/v1/policies/default", json={**policy, "max_background_turns": 2})
    assert put.status_code == 200, put.text
    with (
        openai.OpenAI(base_url=first.url + "/v1", api_key=api_key, max_retries=0) as a,
        openai.OpenAI(base_url=second.url + "/v1", api_key=api_key, max_retries=0) as b,
    ):
        kept = [a.responses.create(model="echo-1", input=f"n{i}", background=True) for i in range(2)]
        wait_for(lambda: all(b.responses.retrieve(r.id).status == "queued" for r in kept), seconds=8)
        with pytest.raises(openai.RateLimitError) as over:
            b.responses.create(model="echo-1", input="one too many", background=True)
        assert over.value.code == "rate_limit_exceeded"
        cancelled = b.responses.cancel(kept[0].id)
        assert cancelled.status == "cancelled"
        assert a.responses.retrieve(kept[0].id).status == "cancelled"
        # its place is free again
        assert b.responses.create(model="echo-1", input="now there is room", background=True).status == "queued"
        stats = admin.get("/admin/v1/stats").json()
        assert stats["background_queued"] == 2 and stats["background_cancelled"] == 1


def test_background_turns_on_the_embedded_default(
    responses_sqlite_server: StatestoreServer, backend: FakeBackend, api_key: str
) -> None:
    """SQLite and no Redis: the events live in the process, which is every replica there is."""
    with openai.OpenAI(base_url=responses_sqlite_server.url + "/v1", api_key=api_key, max_retries=0) as client:
        stall(backend, 0.5, events=2)
        seen = streamed_until(client, "on sqlite", "response.in_progress")
        rest = list(raw_events(responses_sqlite_server.url, api_key, seen[0].response.id, seen[-1].sequence_number))
        numbers = [e.sequence_number for e in seen] + [e["sequence_number"] for e in rest]
        assert numbers == list(range(len(numbers)))
        assert final(client, seen[0].response.id).output_text == "echo: on sqlite"
        stall(backend, 20.0, events=2)
        running = client.responses.create(model="echo-1", input="stop me", background=True)
        wait_for(lambda: client.responses.retrieve(running.id).status == "in_progress")
        assert client.responses.cancel(running.id).status == "cancelled"


def test_cancel_a_turn_queued_on_another_replica_frees_its_conversation(
    own_db_replicas: Callable[..., StatestoreServer], backend: FakeBackend, api_key: str
) -> None:
    busy = own_db_replicas(background_workers="1")
    other = own_db_replicas(background_workers="0")
    with (
        openai.OpenAI(base_url=busy.url + "/v1", api_key=api_key, max_retries=0) as a,
        openai.OpenAI(base_url=other.url + "/v1", api_key=api_key, max_retries=0) as b,
    ):
        stall(backend, 20.0, events=2)
        running = a.responses.create(model="echo-1", input="occupies the worker", background=True)
        wait_for(lambda: b.responses.retrieve(running.id).status == "in_progress")
        conversation = a.conversations.create()
        waiting = a.responses.create(model="echo-1", input="waits", background=True, conversation=conversation.id)
        with pytest.raises(openai.BadRequestError):
            b.responses.create(model="echo-1", input="meanwhile", conversation=conversation.id)
        started = time.monotonic()
        assert b.responses.cancel(waiting.id).status == "cancelled"
        assert time.monotonic() - started < 1.5
        # the conversation is free again, and holds nothing of the cancelled turn
        assert b.responses.create(model="echo-1", input="now", conversation=conversation.id).output_text == "echo: now"
        assert len(b.conversations.items.list(conversation.id).data) == 2
        assert b.responses.cancel(running.id).status == "cancelled"


async def test_the_redis_event_log_keeps_one_run_per_stream_and_takes_a_batch_sent_again_as_written(
    redis_url: str, prefix: str
) -> None:
    client = redis_client(redis_url)
    events = RedisEventLog(client, prefix, cap=100)
    try:
        await events.publish("resp_twice", 0, [Event(0, b"created"), Event(1, b"queued")], 10_000)
        batch = [Event(2, b"in progress"), Event(3, b"delta")]
        await events.publish("resp_twice", 1, batch, 10_000)
        await events.publish("resp_twice", 1, batch, 10_000)  # a publish whose answer was lost, sent again
        assert [e.frame for e in await events.read("resp_twice", -1, block_ms=0)] == [
            b"created",
            b"queued",
            b"in progress",
            b"delta",
        ]
        with pytest.raises(Superseded):  # numbers taken, by this run, with more after them
            await events.publish("resp_twice", 1, [Event(3, b"delta"), Event(4, b"more")], 10_000)
        await events.publish("resp_twice", 2, [Event(4, b"a later run")], 10_000)
        with pytest.raises(Superseded):  # the earlier run, once a later one wrote
            await events.publish("resp_twice", 1, [Event(5, b"late")], 10_000)
        assert await events.last("resp_twice") == (4, 2)
    finally:
        await client.aclose()


async def test_a_publish_that_failed_on_its_way_is_sent_once_more(redis_url: str, prefix: str) -> None:
    """A connection a Redis reset closed fails the first time it is used (uvloop's RuntimeError on the write): the
    client sends the batch again on a fresh connection, not lost, and a follower's blocking read waits on a connection
    of its own."""
    client = redis_client(redis_url)
    events = RedisEventLog(client, prefix, cap=100)
    assert isinstance(events._client, RespClient)
    await events.publish("resp_retried", 1, [Event(1, b"first")], 10_000)
    failures = [RuntimeError("unable to perform operation on <TCPTransport closed=True>")]
    wrapped = 0
    for conn in events._client._slots:
        if conn is not None and conn._transport is not None:
            transport = conn._transport
            real = transport.writelines

            def fails_once(chunks: Any, real: Any = real) -> None:
                if failures:
                    raise failures.pop()
                real(chunks)

            transport.writelines = fails_once  # type: ignore[method-assign,assignment]
            wrapped += 1
    assert wrapped
    try:
        waiting = asyncio.ensure_future(events.read("resp_retried", 2, block_ms=5000))
        await asyncio.sleep(0.2)
        await events.publish("resp_retried", 1, [Event(2, b"kept"), Event(3, b"more")], 10_000)
        assert [e.frame for e in await waiting] == [b"more"]
        assert [e.frame for e in await events.read("resp_retried", 1, block_ms=0)] == [b"kept", b"more"]
        assert not failures
    finally:
        await client.aclose()


async def test_a_closed_redis_transport_is_an_unavailable_event_log(redis_url: str, prefix: str) -> None:
    """Found by the fault campaign: after a reset closed a Redis connection, uvloop raised RuntimeError for the next
    write on it, which escaped the event log. A run's publish then lost its batch and ended a turn it had just stored
    `failed`; a follower's stream broke off. Every event log call must take it as Redis unavailable."""
    client = redis_client(redis_url)
    events = RedisEventLog(client, prefix, cap=100)

    async def closed_transport(*args: object, **kwargs: object) -> object:
        raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")

    events._client.execute = closed_transport  # type: ignore[method-assign]
    events._client.blocking = closed_transport  # type: ignore[method-assign]
    try:
        with pytest.raises(EventLogUnavailable):
            await events.publish("resp_closed", 1, [Event(2, b"event: x\n\n")], 1000)
        with pytest.raises(EventLogUnavailable):
            await events.read("resp_closed", 1, block_ms=0)
        with pytest.raises(EventLogUnavailable):
            await events.read("resp_closed", 1, block_ms=100)
        with pytest.raises(EventLogUnavailable):
            await events.last("resp_closed")
    finally:
        await client.aclose()


def _as_if_the_run_stopped_before_its_end(
    db_url: str, redis_url: str, prefix: str, response_id: str, *, cancel_requested: bool
) -> None:
    """What a run leaves when its commit was carried out but the run stopped before it said so (the commit's answer
    lost as PostgreSQL restarted, its replica gone): the response stored, its background row still in progress
    under a claim that ran out, and its event log without the final event, which was never published."""

    async def rewind() -> None:
        engine = create_async_engine(db_url, poolclass=NullPool)
        try:
            async with engine.begin() as conn:
                changed = await conn.execute(
                    text(
                        "UPDATE background_responses SET status = 'in_progress', claim_token = 'a-replica-gone', "
                        "claim_expires_ms = 1, cancel_requested = :cancel WHERE id = :id"
                    ),
                    {"id": response_id, "cancel": cancel_requested},
                )
                assert changed.rowcount == 1
        finally:
            await engine.dispose()

    asyncio.run(rewind())
    store = redis.Redis.from_url(redis_url)
    key = f"{prefix}bg:{{{response_id}}}:events"
    entries = cast(list[tuple[bytes, dict[bytes, bytes]]], store.xrange(key))
    assert entries[-1][1][b"z"] == b"1"  # the final event, which the stopped run never published
    store.delete(key)
    for entry_id, fields in entries[:-1]:
        store.xadd(key, cast(Any, fields), id=entry_id)
    store.pexpire(key, 600_000)


@pytest.mark.parametrize("cancelled_before_the_take_over", [False, True])
def test_a_turn_stored_by_a_run_that_stopped_before_saying_so_ends_completed_though_cancelled(
    own_db: str,
    own_db_replicas: Callable[..., StatestoreServer],
    redis_url: str,
    api_key: str,
    cancelled_before_the_take_over: bool,
) -> None:
    """Found by the fault campaign (seed 1515): a streamed background turn's commit went through while PostgreSQL
    restarted, its run broke off before it ended the turn, and a cancel then ended as `cancelled` a turn whose
    response was stored: retrieved `completed`, its events ending `response.cancelled`. Whoever ends such a turn,
    a cancel of it or the replica that takes it over, ends it as it was stored."""
    ran_it = own_db_replicas()
    with openai.OpenAI(base_url=ran_it.url + "/v1", api_key=api_key, max_retries=0) as a:
        done = final(a, a.responses.create(model="echo-1", input="stored, then cut", background=True).id)
        assert done.status == "completed"
    ran_it.stop()
    _as_if_the_run_stopped_before_its_end(
        own_db, redis_url, ran_it.redis_prefix, done.id, cancel_requested=cancelled_before_the_take_over
    )
    # a replica that runs turns takes the cancelled one over; one that runs none leaves the other to the cancel
    other = own_db_replicas(background_workers="1" if cancelled_before_the_take_over else "0")
    with openai.OpenAI(base_url=other.url + "/v1", api_key=api_key, max_retries=0) as b:
        if cancelled_before_the_take_over:
            wait_for(lambda: _background_status(own_db, done.id) != "in_progress")
        else:
            assert b.responses.cancel(done.id).status == "completed"
        assert _background_status(own_db, done.id) == "completed"
        assert b.responses.retrieve(done.id).status == "completed"
        events = list(raw_events(other.url, api_key, done.id, None))
        assert events[-1]["type"] == "response.completed"
        assert events[-1]["response"]["output"][0]["content"][0]["text"] == "echo: stored, then cut"
        assert [e["sequence_number"] for e in events] == list(range(len(events)))


def _background_status(db_url: str, response_id: str) -> str:
    async def read() -> str:
        engine = create_async_engine(db_url, poolclass=NullPool)
        try:
            async with engine.connect() as conn:
                found = await conn.execute(
                    text("SELECT status FROM background_responses WHERE id = :id"), {"id": response_id}
                )
                return str(found.scalar_one())
        finally:
            await engine.dispose()

    return asyncio.run(read())


def test_a_turn_cancelled_while_its_replica_was_gone_ends_cancelled_in_its_own_event_log(
    own_db_replicas: Callable[..., StatestoreServer], backend: FakeBackend, redis_url: str, api_key: str
) -> None:
    """A streamed turn whose replica was killed after it had published events, cancelled before anyone took it
    over: the replica that takes it over ends it cancelled, and its final event goes into the event log after the
    run's own (it was numbered as a first run's, refused as taken, and left to followers to tell from storage)."""
    doomed = own_db_replicas(background_workers="1")
    admitting = own_db_replicas(background_workers="0")
    with openai.OpenAI(base_url=doomed.url + "/v1", api_key=api_key, max_retries=0) as a:
        stall(backend, 30.0, events=2)
        seen = streamed_until(a, "orphaned", "response.output_text.delta")
        response_id = seen[0].response.id
    os.kill(doomed.process.pid, signal.SIGKILL)
    doomed.process.wait()
    with openai.OpenAI(base_url=admitting.url + "/v1", api_key=api_key, max_retries=0) as b:
        # The claim is still live: the cancel marks the turn and, nobody running it, answers it as it stands.
        assert b.responses.cancel(response_id).status in ("in_progress", "cancelled")
        own_db_replicas(background_workers="1")  # takes it over once the dead replica's claim runs out
        assert final(b, response_id, seconds=20).status == "cancelled"
    store = redis.Redis.from_url(redis_url)
    entries = cast(
        list[tuple[bytes, dict[bytes, bytes]]], store.xrange(f"{admitting.redis_prefix}bg:{{{response_id}}}:events")
    )
    last_frame = entries[-1][1][b"f"]
    assert entries[-1][1][b"z"] == b"1" and b"event: response.cancelled" in last_frame
    numbers = [int(entry_id.split(b"-")[1]) - 1 for entry_id, _ in entries]
    assert numbers == list(range(len(numbers)))
    events = list(raw_events(admitting.url, api_key, response_id, None))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.cancelled"
