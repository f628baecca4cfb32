"""`client.conversations.*` and turns on a conversation: items appended only when a turn completes, never
interleaved, and a second turn refused while one holds the conversation."""

from __future__ import annotations

import asyncio

import openai
import orjson
import pytest
import redis
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from tests.integration.responses.conftest import Rows, chat_requests, id_of, last_chat_request, other_key, texts
from tests.support.fake_backend import FakeBackend
from tests.support.server import StatestoreServer

SLOW = {"kind": "echo", "path": "/v1/chat/completions", "delay_seconds": 1.5}


def test_conversation_crud_and_items(any_openai_client: openai.OpenAI) -> None:
    openai_client = any_openai_client
    conversation = openai_client.conversations.create(
        items=[{"type": "message", "role": "user", "content": "remember 42"}], metadata={"topic": "numbers"}
    )
    assert conversation.id.startswith("conv_") and conversation.metadata == {"topic": "numbers"}
    assert openai_client.conversations.retrieve(conversation.id).id == conversation.id
    updated = openai_client.conversations.update(conversation.id, metadata={"topic": "maths"})
    assert updated.metadata == {"topic": "maths"}
    added = openai_client.conversations.items.create(
        conversation.id, items=[{"type": "message", "role": "user", "content": "and 7"}]
    )
    assert id_of(added.data[0]).startswith("msg_")
    listed = openai_client.conversations.items.list(conversation.id, order="asc")
    assert texts(listed.data) == ["remember 42", "and 7"]
    newest_first = openai_client.conversations.items.list(conversation.id)
    assert texts(newest_first.data) == ["and 7", "remember 42"]
    first_id = id_of(listed.data[0])
    assert openai_client.conversations.items.retrieve(first_id, conversation_id=conversation.id).id == first_id
    openai_client.conversations.items.delete(first_id, conversation_id=conversation.id)
    assert [i.id for i in openai_client.conversations.items.list(conversation.id)] == [id_of(listed.data[1])]
    deleted = openai_client.conversations.delete(conversation.id)
    assert deleted.deleted is True
    with pytest.raises(openai.NotFoundError):
        openai_client.conversations.retrieve(conversation.id)


def test_turns_on_a_conversation_see_and_extend_its_items(
    any_openai_client: openai.OpenAI, backend: FakeBackend
) -> None:
    openai_client = any_openai_client
    conversation = openai_client.conversations.create(items=[{"role": "user", "content": "hi"}])
    first = openai_client.responses.create(model="echo-1", input="one", conversation=conversation.id)
    assert first.conversation is not None and first.conversation.id == conversation.id
    with openai_client.responses.stream(model="echo-1", input="two", conversation={"id": conversation.id}) as stream:
        stream.get_final_response()
    assert [m["content"] for m in chat_requests(backend)[-1]["messages"]] == ["hi", "one", "echo: one", "two"]
    assert texts(openai_client.responses.input_items.list(first.id).data) == ["one"]
    openai_client.responses.create(model="echo-1", input="from the first", previous_response_id=first.id)
    assert [m["content"] for m in chat_requests(backend)[-1]["messages"]] == ["one", "echo: one", "from the first"]
    items = openai_client.conversations.items.list(conversation.id, order="asc")
    assert [i.model_dump()["role"] for i in items.data] == ["user", "user", "assistant", "user", "assistant"]
    with pytest.raises(openai.BadRequestError):
        openai_client.responses.create(
            model="echo-1", input="x", conversation=conversation.id, previous_response_id=first.id
        )
    # store: false stores nothing anywhere, the conversation's items included
    unstored = openai_client.responses.create(
        model="echo-1", input="off the record", conversation=conversation.id, store=False
    )
    assert unstored.output_text == "echo: off the record"
    assert len(openai_client.conversations.items.list(conversation.id).data) == 5


def test_an_unknown_or_foreign_conversation_is_not_found(
    openai_client: openai.OpenAI, responses_server: StatestoreServer
) -> None:
    conversation = openai_client.conversations.create()
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.create(model="echo-1", input="x", conversation="conv_nope")
    with openai.OpenAI(base_url=responses_server.url + "/v1", api_key=other_key(), max_retries=0) as stranger:
        with pytest.raises(openai.NotFoundError):
            stranger.responses.create(model="echo-1", input="x", conversation=conversation.id)
        with pytest.raises(openai.NotFoundError):
            stranger.conversations.items.list(conversation.id)
        with pytest.raises(openai.NotFoundError):
            stranger.conversations.delete(conversation.id)


async def _backend_received(backend: FakeBackend, count: int) -> None:
    while len(chat_requests(backend)) < count:
        await asyncio.sleep(0.02)


async def test_concurrent_turns_on_one_conversation(
    async_openai_client: openai.AsyncOpenAI, backend: FakeBackend, rows: Rows, api_key: str
) -> None:
    client = async_openai_client
    conversation = await client.conversations.create()
    backend.script(SLOW)
    first = asyncio.create_task(client.responses.create(model="echo-1", input="first", conversation=conversation.id))
    await asyncio.wait_for(_backend_received(backend, 1), 10)
    with pytest.raises(openai.BadRequestError) as locked:
        await client.responses.create(model="echo-1", input="second", conversation=conversation.id)
    assert locked.value.code == "conversation_locked" and locked.value.param == "conversation"
    with pytest.raises(openai.BadRequestError) as adding:
        await client.conversations.items.create(conversation.id, items=[{"role": "user", "content": "sneak"}])
    assert adding.value.code == "conversation_locked"
    await first
    after = await client.responses.create(model="echo-1", input="third", conversation=conversation.id)
    assert after.output_text == "echo: third"
    items = await client.conversations.items.list(conversation.id, order="asc")
    assert texts(items.data) == ["first", "echo: first", "third", "echo: third"]
    # many at once: exactly one wins each time, and items never interleave
    backend.script(SLOW)
    results = await asyncio.gather(
        *(client.responses.create(model="echo-1", input=f"r{i}", conversation=conversation.id) for i in range(5)),
        return_exceptions=True,
    )
    winners = [r for r in results if not isinstance(r, BaseException)]
    assert len(winners) == 1
    assert all(
        isinstance(r, openai.BadRequestError) and r.code == "conversation_locked" for r in results if r not in winners
    )
    items = await client.conversations.items.list(conversation.id, order="asc")
    said = texts(items.data)
    assert said[4:] == [winners[0].output_text.removeprefix("echo: "), winners[0].output_text]
    assert (await rows.counts(api_key))["conversation_items"] == 6


def test_a_conversation_turn_sends_the_same_bytes_from_the_cache_and_the_database(
    openai_client: openai.OpenAI, backend: FakeBackend, redis_url: str, responses_redis_prefix: str
) -> None:
    client = openai_client
    conversation = client.conversations.create(items=[{"role": "user", "content": "hi"}])
    joined, count = (f"{responses_redis_prefix}{{conv:{conversation.id}}}:{part}" for part in ("h", "n"))
    cache = redis.Redis.from_url(redis_url)

    def probe() -> bytes:
        """What an unstored turn on the conversation sends the backend (it reads the context and stores nothing)."""
        client.responses.create(model="echo-1", input="probe", conversation=conversation.id, store=False)
        return last_chat_request(backend).body

    def probe_warm_and_cold() -> bytes:
        warm = probe()
        cache.delete(joined, count)
        cold = probe()
        assert warm == cold
        return cold

    def history(body: bytes) -> list[str]:
        return [m["content"] for m in orjson.loads(body)["messages"]][:-1]

    try:
        first = client.responses.create(model="echo-1", input="one", conversation=conversation.id)
        assert cache.get(count) == b"2:3"  # written by the commit, at the position it made
        assert history(probe_warm_and_cold()) == ["hi", "one", "echo: one"]
        client.responses.create(model="echo-1", input="two", conversation=conversation.id)  # a miss, then written
        # The entry is what a turn reads: a changed one (same position) is sent as it is.
        stored = cache.get(joined)
        assert stored is not None
        cache.set(joined, b'{"role":"user","content":"from the cache"}', keepttl=True)
        assert history(probe()) == ["from the cache"]
        cache.set(joined, stored, keepttl=True)
        assert history(probe_warm_and_cold()) == ["hi", "one", "echo: one", "two", "echo: two"]

        # An item added through the Conversations API: the entry goes, and a stale writer's entry (the old position)
        # put back afterwards is not used.
        client.responses.create(model="echo-1", input="three", conversation=conversation.id)
        stale = (cache.get(joined), cache.get(count))
        client.conversations.items.create(conversation.id, items=[{"role": "user", "content": "added"}])
        assert not cache.exists(joined)
        cache.set(joined, stale[0] or b"", px=60_000)
        cache.set(count, stale[1] or b"", px=60_000)
        assert history(probe_warm_and_cold())[-3:] == ["three", "echo: three", "added"]

        # An item deleted: gone from the context, warm or cold, and from the input_items of the response it came in.
        client.responses.create(model="echo-1", input="four", conversation=conversation.id)
        stale = (cache.get(joined), cache.get(count))
        one = next(i for i in client.conversations.items.list(conversation.id).data if texts([i]) == ["one"])
        assert texts(client.responses.input_items.list(first.id).data) == ["one"]
        client.conversations.items.delete(id_of(one), conversation_id=conversation.id)
        cache.set(joined, stale[0] or b"", px=60_000)
        cache.set(count, stale[1] or b"", px=60_000)
        sent = history(probe_warm_and_cold())
        assert "one" not in sent and sent[:2] == ["hi", "echo: one"] and sent[-2:] == ["four", "echo: four"]
        assert client.responses.input_items.list(first.id).data == []
        client.responses.create(model="echo-1", input="five", conversation=conversation.id)
        assert history(probe_warm_and_cold())[-2:] == ["five", "echo: five"]
    finally:
        cache.close()


async def test_a_conversation_turn_stores_its_items_once(
    async_openai_client: openai.AsyncOpenAI, backend: FakeBackend, rows: Rows, api_key: str
) -> None:
    client = async_openai_client
    conversation = await client.conversations.create(items=[{"role": "user", "content": "hi"}])
    turn = await client.responses.create(model="echo-1", input="one", conversation=conversation.id)
    assert await rows.counts(api_key) == {"responses": 1, "response_items": 0, "conversation_items": 3}
    assert texts((await client.responses.input_items.list(turn.id)).data) == ["one"]
    # A chain may start from a conversation's response: its context is that response's items, read where they are.
    chained = await client.responses.create(model="echo-1", input="two", previous_response_id=turn.id)
    assert [m["content"] for m in chat_requests(backend)[-1]["messages"]] == ["one", "echo: one", "two"]
    assert await rows.counts(api_key) == {"responses": 2, "response_items": 2, "conversation_items": 3}
    # Stored once, deleted once: with the conversation, its items are gone from its responses and from the contexts
    # of the chains begun on them (their cached contexts included).
    await client.conversations.delete(conversation.id)
    assert (await client.responses.input_items.list(turn.id)).data == []
    await client.responses.create(model="echo-1", input="three", previous_response_id=chained.id)
    assert [m["content"] for m in chat_requests(backend)[-1]["messages"]] == ["two", "echo: two", "three"]
    # Deleting a response leaves its conversation's items: they are the conversation's.
    other = await client.conversations.create()
    kept = await client.responses.create(model="echo-1", input="kept", conversation=other.id)
    await client.responses.delete(kept.id)
    assert texts((await client.conversations.items.list(other.id, order="asc")).data) == ["kept", "echo: kept"]


async def test_a_deletion_after_the_lease_ran_out_takes_the_conversation_over(
    async_openai_client: openai.AsyncOpenAI, backend: FakeBackend, responses_pg_url: str
) -> None:
    """A turn whose lease ran out (here: made to, in the database) cannot commit once an item was deleted meanwhile:
    it was given the context with that item, and storing its reply after it would cache and extend stale state."""
    client = async_openai_client
    conversation = await client.conversations.create(items=[{"role": "user", "content": "secret"}])
    secret = (await client.conversations.items.list(conversation.id)).data[0]
    counted = await _responses_turns_counted(responses_pg_url)
    backend.script(SLOW)
    late = asyncio.create_task(client.responses.create(model="echo-1", input="late", conversation=conversation.id))
    await asyncio.wait_for(_backend_received(backend, 1), 10)
    engine = create_async_engine(responses_pg_url, poolclass=NullPool)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                text("UPDATE conversations SET lease_expires_ms = 0 WHERE id = :c"), {"c": conversation.id}
            )
    finally:
        await engine.dispose()
    await client.conversations.items.delete(id_of(secret), conversation_id=conversation.id)
    with pytest.raises(openai.BadRequestError) as lost:
        await late
    assert lost.value.code == "conversation_locked"
    assert (await client.conversations.items.list(conversation.id)).data == []
    assert await _responses_turns_counted(responses_pg_url) == counted, "a turn not stored is not counted"
    await client.responses.create(model="echo-1", input="after", conversation=conversation.id)
    assert [m["content"] for m in chat_requests(backend)[-1]["messages"]] == ["after"]
    assert await _responses_turns_counted(responses_pg_url) == counted + 1


async def _responses_turns_counted(database_url: str) -> int:
    """Every Responses turn the daily usage has counted (the console's charts, GET /admin/v1/usage)."""
    engine = create_async_engine(database_url, poolclass=NullPool)
    try:
        async with engine.connect() as conn:
            query = text("SELECT coalesce(sum(turns), 0) FROM daily_usage WHERE door = 'responses'")
            return int((await conn.execute(query)).scalar_one())
    finally:
        await engine.dispose()


async def test_an_item_deleted_while_a_chain_begun_on_its_conversation_waits_is_not_sent_again(
    async_openai_client: openai.AsyncOpenAI, backend: FakeBackend
) -> None:
    """A chain begun on a conversation's response reads that conversation's items. A turn of the chain that read its
    context before an item was deleted, and stores its reply after, must not cache the deleted item for the turns
    after it: the deletion could not drop an entry that did not exist yet."""
    client = async_openai_client
    conversation = await client.conversations.create()
    root = await client.responses.create(model="echo-1", input="secret", conversation=conversation.id)
    secret = (await client.conversations.items.list(conversation.id, order="asc")).data[0]
    backend.script(SLOW)
    middle = asyncio.create_task(client.responses.create(model="echo-1", input="middle", previous_response_id=root.id))
    await asyncio.wait_for(_backend_received(backend, 2), 10)
    assert "secret" in [m["content"] for m in chat_requests(backend)[-1]["messages"]]  # read before the deletion
    await client.conversations.items.delete(id_of(secret), conversation_id=conversation.id)
    await client.responses.create(model="echo-1", input="after", previous_response_id=(await middle).id)
    sent = [m["content"] for m in chat_requests(backend)[-1]["messages"]]
    assert sent == ["echo: secret", "middle", "echo: middle", "after"]
