"""`Idempotency-Key` on the Responses door's writes (docs/responses.md, "Retries that never store twice"): the same
key with the same body returns the first outcome (same ids, same body; a stream replayed as its events) and stores
nothing again; a different body is refused naming the key; a key still running is a 409; a request that failed
without storing frees its key. Driven by the official `openai` SDK, on both storage set-ups."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from tests.integration.responses.conftest import owner_of, texts
from tests.support.fake_backend import FakeBackend
from tests.support.server import StatestoreServer

SLOW = {"kind": "echo", "path": "/v1/chat/completions", "delay_seconds": 1.5}


def keyed(key: str) -> dict[str, str]:
    return {"Idempotency-Key": key}


def new_key() -> str:
    return "key-" + secrets.token_hex(8)


def test_a_turn_sent_twice_with_one_key_is_stored_once(any_openai_client: openai.OpenAI) -> None:
    client = any_openai_client
    conversation = client.conversations.create()
    key = new_key()
    first = client.responses.create(
        model="echo-1", input="once", conversation=conversation.id, extra_headers=keyed(key)
    )
    again = client.responses.with_raw_response.create(
        model="echo-1", input="once", conversation=conversation.id, extra_headers=keyed(key)
    )
    assert again.headers.get("idempotent-replayed") == "true"
    replayed = again.parse()
    assert replayed.id == first.id and replayed.output_text == first.output_text == "echo: once"
    assert replayed.model_dump(warnings=False) == first.model_dump(warnings=False)
    assert texts(client.conversations.items.list(conversation.id, order="asc").data) == ["once", "echo: once"]
    # Another key is another request.
    other = client.responses.create(
        model="echo-1", input="once", conversation=conversation.id, extra_headers=keyed(new_key())
    )
    assert other.id != first.id
    assert len(client.conversations.items.list(conversation.id).data) == 4


def test_a_chain_turn_sent_twice_forks_no_sibling(any_openai_client: openai.OpenAI) -> None:
    client = any_openai_client
    root = client.responses.create(model="echo-1", input="root")
    key = new_key()
    first = client.responses.create(
        model="echo-1", input="next", previous_response_id=root.id, extra_headers=keyed(key)
    )
    again = client.responses.create(
        model="echo-1", input="next", previous_response_id=root.id, extra_headers=keyed(key)
    )
    assert again.id == first.id
    # The root was continued once: continuing the replayed id goes on from it.
    after = client.responses.create(model="echo-1", input="then", previous_response_id=again.id)
    assert texts(client.responses.input_items.list(after.id).data) == ["then"]


def test_a_streamed_turn_is_replayed_as_the_same_events(any_openai_client: openai.OpenAI) -> None:
    client = any_openai_client
    conversation = client.conversations.create()
    key = new_key()

    def events() -> list[dict[str, Any]]:
        with client.responses.stream(
            model="echo-1", input="streamed", conversation=conversation.id, extra_headers=keyed(key)
        ) as stream:
            return [event.model_dump(warnings=False) for event in stream]

    first, second = events(), events()
    assert second == first
    assert first[-1]["type"] == "response.completed"
    assert texts(client.conversations.items.list(conversation.id, order="asc").data) == ["streamed", "echo: streamed"]


def test_conversation_items_appended_twice_with_one_key_are_stored_once(any_openai_client: openai.OpenAI) -> None:
    client = any_openai_client
    conversation = client.conversations.create()
    key = new_key()
    items: Any = [{"type": "message", "role": "user", "content": f"item {i}"} for i in range(3)]
    first = client.conversations.items.create(conversation.id, items=items, extra_headers=keyed(key))
    again = client.conversations.items.create(conversation.id, items=items, extra_headers=keyed(key))
    assert [i.id for i in again.data] == [i.id for i in first.data]
    assert texts(client.conversations.items.list(conversation.id, order="asc").data) == ["item 0", "item 1", "item 2"]


def test_a_key_reused_with_another_body_is_refused_naming_the_key(any_openai_client: openai.OpenAI) -> None:
    client = any_openai_client
    key = new_key()
    client.responses.create(model="echo-1", input="the first words", extra_headers=keyed(key))
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        client.responses.create(model="echo-1", input="other secret words", extra_headers=keyed(key))
    assert refused.value.code == "idempotency_key_reused"
    assert key in refused.value.message and "secret" not in str(refused.value.body)
    # The key is owner-scoped: another credential's request with it is its own.
    other_key = "sk-other-" + secrets.token_hex(8)
    with openai.OpenAI(base_url=str(client.base_url), api_key=other_key, max_retries=0) as other:
        assert (
            other.responses.create(model="echo-1", input="mine", extra_headers=keyed(key)).output_text == "echo: mine"
        )


def test_a_failed_attempt_frees_its_key(any_openai_client: openai.OpenAI) -> None:
    client = any_openai_client
    key = new_key()
    with pytest.raises(openai.BadRequestError):
        client.responses.create(
            model="echo-1", input="x", previous_response_id="resp_" + "0" * 32, extra_headers=keyed(key)
        )
    fixed = client.responses.create(model="echo-1", input="fixed", extra_headers=keyed(key))
    assert fixed.output_text == "echo: fixed"


def test_a_malformed_key_is_refused(any_openai_client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        any_openai_client.responses.create(model="echo-1", input="x", extra_headers=keyed("x" * 300))
    assert refused.value.param == "Idempotency-Key"


async def test_a_key_still_running_is_a_409(
    responses_server: StatestoreServer, api_key: str, backend: FakeBackend
) -> None:
    async with openai.AsyncOpenAI(base_url=responses_server.url + "/v1", api_key=api_key, max_retries=0) as client:
        key = new_key()
        backend.script(SLOW)
        first = asyncio.create_task(client.responses.create(model="echo-1", input="slow", extra_headers=keyed(key)))
        await asyncio.sleep(0.6)
        with pytest.raises(openai.ConflictError) as conflict:
            await client.responses.create(model="echo-1", input="slow", extra_headers=keyed(key))
        assert conflict.value.code == "idempotency_key_in_flight" and key in conflict.value.message
        done = await first
        replayed = await client.responses.create(model="echo-1", input="slow", extra_headers=keyed(key))
        assert replayed.id == done.id


def test_background_turns_are_admitted_once(any_openai_client: openai.OpenAI) -> None:
    client = any_openai_client
    key = new_key()
    first = client.responses.create(model="echo-1", input="later", background=True, extra_headers=keyed(key))
    again = client.responses.create(model="echo-1", input="later", background=True, extra_headers=keyed(key))
    assert again.id == first.id


async def _rows(url: str, sql: str, **params: Any) -> list[Any]:
    engine = create_async_engine(url, poolclass=NullPool)
    try:
        async with engine.begin() as conn:
            result = await conn.execute(text(sql), params)
            return list(result.all()) if result.returns_rows else []
    finally:
        await engine.dispose()


async def test_a_retry_after_an_unrecorded_outcome_replays_the_stored_turn(
    responses_server: StatestoreServer, responses_pg_url: str, api_key: str
) -> None:
    """A replica that stored the turn and died before it recorded the outcome under the key: the key holds the id
    the turn was to store, so a retry finds the turn and replays it instead of storing it again."""
    async with openai.AsyncOpenAI(base_url=responses_server.url + "/v1", api_key=api_key, max_retries=0) as client:
        conversation = await client.conversations.create()
        key = new_key()
        first = await client.responses.create(
            model="echo-1", input="kept", conversation=conversation.id, extra_headers=keyed(key)
        )
        await _rows(
            responses_pg_url,
            "UPDATE idempotency_keys SET outcome = NULL, status = NULL, claim_token = 'gone', claim_expires_ms = 1 "
            "WHERE owner = :o AND key = :k",
            o=owner_of(api_key),
            k=key,
        )
        again = await client.responses.create(
            model="echo-1", input="kept", conversation=conversation.id, extra_headers=keyed(key)
        )
        assert again.id == first.id and again.output_text == "echo: kept"
        items = await client.conversations.items.list(conversation.id)
        assert len(items.data) == 2


def test_a_key_holds_across_replicas(
    responses_server: StatestoreServer, responses_pg_url: str, redis_url: str, api_key: str, fake_backend_process: Any
) -> None:
    replica = StatestoreServer(
        database_url=responses_pg_url,
        upstream_url=fake_backend_process.url,
        redis_url=redis_url,
        redis_prefix=responses_server.redis_prefix,
        env={"STATESTORE_CHAT_UPSTREAM_URL": fake_backend_process.url},
    )
    try:
        key = new_key()
        with openai.OpenAI(base_url=responses_server.url + "/v1", api_key=api_key, max_retries=0) as one:
            first = one.responses.create(model="echo-1", input="anywhere", extra_headers=keyed(key))
        with openai.OpenAI(base_url=replica.url + "/v1", api_key=api_key, max_retries=0) as two:
            assert two.responses.create(model="echo-1", input="anywhere", extra_headers=keyed(key)).id == first.id
    finally:
        replica.stop()


def test_a_key_without_a_write_is_ignored_by_reads(responses_server: StatestoreServer, api_key: str) -> None:
    """Reads take no key: a GET with one is served as ever."""
    with openai.OpenAI(base_url=responses_server.url + "/v1", api_key=api_key, max_retries=0) as client:
        made = client.responses.create(model="echo-1", input="read me")
    got = httpx.get(
        f"{responses_server.url}/v1/responses/{made.id}",
        headers={"authorization": f"Bearer {api_key}", "idempotency-key": new_key()},
    )
    assert got.status_code == 200 and got.json()["id"] == made.id
