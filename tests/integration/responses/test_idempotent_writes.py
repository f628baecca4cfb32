"""`Idempotency-Key` on the rest of the Responses door's writes (docs/responses.md, "Retries that never store twice"):
`POST /v1/responses/compact`, creating and updating a conversation, and the deletes. The same key with the same
request gets the first outcome (same ids, `idempotent-replayed: true`) and nothing is stored or deleted again; another
request with the key is a 422 naming it, in OpenAI's error shape; a delete sent again gets its first 200, not a 404.
Driven by the official `openai` SDK with its retries, on PostgreSQL+Redis and SQLite."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from tests.integration.responses.conftest import ADMIN_TOKEN, CHAT_PATH, id_of, owner_of, texts
from tests.support.admin_api import AdminApi
from tests.support.fake_backend import FakeBackend
from tests.support.server import StatestoreServer

ITEMS: Any = [{"type": "message", "role": "user", "content": f"first {i}"} for i in range(2)]


def keyed(key: str) -> dict[str, str]:
    return {"Idempotency-Key": key}


def new_key() -> str:
    return "key-" + secrets.token_hex(8)


@pytest.fixture(params=["postgres", "sqlite"])
def door(request: pytest.FixtureRequest) -> StatestoreServer:
    served: StatestoreServer = request.getfixturevalue(
        "responses_server" if request.param == "postgres" else "responses_sqlite_server"
    )
    return served


@pytest.fixture
def client(door: StatestoreServer, api_key: str) -> Iterator[openai.OpenAI]:
    """The SDK as an application uses it: with its retries (a 409 in flight, a timeout, a 5xx are sent again)."""
    with openai.OpenAI(base_url=door.url + "/v1", api_key=api_key, max_retries=3) as sdk:
        yield sdk


def count(server: StatestoreServer, sql: str, **params: Any) -> int:
    async def read() -> int:
        engine = create_async_engine(server.database_url, poolclass=NullPool)
        try:
            async with engine.connect() as conn:
                return int((await conn.execute(text(sql), params)).scalar_one())
        finally:
            await engine.dispose()

    return asyncio.run(read())


def conversations_of(server: StatestoreServer, api_key: str) -> int:
    return count(server, "SELECT count(*) FROM conversations WHERE owner = :o", o=owner_of(api_key))


def assert_reused(refused: pytest.ExceptionInfo[openai.UnprocessableEntityError], key: str) -> None:
    """The refusal of a key used with another request: OpenAI's error shape, naming the key, never the content."""
    error = refused.value
    assert error.status_code == 422 and error.code == "idempotency_key_reused"
    assert error.response.json() == {"error": error.body}
    assert isinstance(error.body, dict)
    assert error.body["type"] == "invalid_request_error" and error.body["param"] == "Idempotency-Key"
    assert key in error.message and "secret" not in error.response.text
    assert error.response.headers["x-should-retry"] == "false"


def replayed(raw: Any) -> bool:
    return bool(raw.headers.get("idempotent-replayed") == "true")


def test_a_conversation_created_twice_with_one_key_is_one_conversation(
    client: openai.OpenAI, door: StatestoreServer, api_key: str
) -> None:
    key = new_key()
    before = conversations_of(door, api_key)
    first = client.conversations.create(items=ITEMS, metadata={"topic": "a"}, extra_headers=keyed(key))
    again = client.conversations.with_raw_response.create(
        items=ITEMS, metadata={"topic": "a"}, extra_headers=keyed(key)
    )
    assert replayed(again) and not replayed(client.conversations.with_raw_response.retrieve(first.id))
    assert again.parse().model_dump() == first.model_dump()
    assert conversations_of(door, api_key) == before + 1
    assert texts(client.conversations.items.list(first.id, order="asc").data) == ["first 0", "first 1"]
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        client.conversations.create(items=ITEMS, metadata={"topic": "secret b"}, extra_headers=keyed(key))
    assert_reused(refused, key)
    assert conversations_of(door, api_key) == before + 1


def test_a_conversation_update_sent_twice_is_replayed(client: openai.OpenAI) -> None:
    conversation = client.conversations.create()
    key = new_key()
    first = client.conversations.update(conversation.id, metadata={"stage": "one"}, extra_headers=keyed(key))
    client.conversations.update(conversation.id, metadata={"stage": "between"})
    again = client.conversations.with_raw_response.update(
        conversation.id, metadata={"stage": "one"}, extra_headers=keyed(key)
    )
    # The first outcome, not applied again: the update made between stands.
    assert replayed(again) and again.parse().metadata == first.metadata == {"stage": "one"}
    assert client.conversations.retrieve(conversation.id).metadata == {"stage": "between"}
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        client.conversations.update(conversation.id, metadata={"stage": "secret"}, extra_headers=keyed(key))
    assert_reused(refused, key)
    # The key names the route too: the same body on another conversation is another request.
    other = client.conversations.create()
    with pytest.raises(openai.UnprocessableEntityError):
        client.conversations.update(other.id, metadata={"stage": "one"}, extra_headers=keyed(key))


def test_a_compaction_sent_twice_is_the_same_compaction_asked_once(client: openai.OpenAI, backend: FakeBackend) -> None:
    previous = client.responses.create(model="echo-1", input="remember the number 42").id
    key = new_key()
    asked = len([r for r in backend.requests() if r.path == CHAT_PATH])
    first = client.responses.compact(
        model="echo-1", previous_response_id=previous, input="and 7", extra_headers=keyed(key)
    )
    again = client.responses.with_raw_response.compact(
        model="echo-1", previous_response_id=previous, input="and 7", extra_headers=keyed(key)
    )
    assert replayed(again)
    assert again.parse().model_dump(warnings=False) == first.model_dump(warnings=False)
    assert [item.id for item in again.parse().output] == [item.id for item in first.output]
    assert len([r for r in backend.requests() if r.path == CHAT_PATH]) == asked + 1
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        client.responses.compact(
            model="echo-1", previous_response_id=previous, input="secret 8", extra_headers=keyed(key)
        )
    assert_reused(refused, key)


def test_a_compaction_whose_answer_was_late_is_retried_by_the_sdk_and_asked_once(
    door: StatestoreServer, api_key: str, backend: FakeBackend
) -> None:
    """The SDK gives up waiting (its timeout) and sends the request again with the key: the retry waits for the
    first (409 in flight, retry-after 1, retried by the SDK) and gets its compaction; the backend is asked once."""
    key = new_key()
    backend.script({"kind": "echo", "path": CHAT_PATH, "delay_seconds": 2.0})
    with openai.OpenAI(base_url=door.url + "/v1", api_key=api_key, max_retries=4, timeout=1.0) as impatient:
        compacted = impatient.responses.with_raw_response.compact(
            model="echo-1", input="summarise me", extra_headers=keyed(key)
        )
    assert replayed(compacted) and compacted.retries_taken >= 1
    assert len([r for r in backend.requests() if r.path == CHAT_PATH]) == 1
    with openai.OpenAI(base_url=door.url + "/v1", api_key=api_key, max_retries=0) as plain:
        again = plain.responses.compact(model="echo-1", input="summarise me", extra_headers=keyed(key))
    assert again.model_dump(warnings=False) == compacted.parse().model_dump(warnings=False)


def test_a_response_deleted_twice_with_one_key_answers_the_first_200(client: openai.OpenAI) -> None:
    made = client.responses.create(model="echo-1", input="delete me")
    key = new_key()
    first = client.responses.with_raw_response.delete(made.id, extra_headers=keyed(key))
    again = client.responses.with_raw_response.delete(made.id, extra_headers=keyed(key))
    assert first.status_code == again.status_code == 200 and replayed(again)
    assert (
        again.http_response.json()
        == first.http_response.json()
        == {
            "id": made.id,
            "object": "response.deleted",
            "deleted": True,
        }
    )
    with pytest.raises(openai.NotFoundError):  # without the key, a delete of what is gone is a 404
        client.responses.delete(made.id)
    other = client.responses.create(model="echo-1", input="another")
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        client.responses.delete(other.id, extra_headers=keyed(key))
    assert_reused(refused, key)
    assert client.responses.retrieve(other.id).id == other.id


def test_a_conversation_and_an_item_deleted_twice_answer_the_first_200(client: openai.OpenAI) -> None:
    conversation = client.conversations.create(items=ITEMS)
    item = id_of(client.conversations.items.list(conversation.id, order="asc").data[0])
    key = new_key()
    first = client.conversations.items.delete(item, conversation_id=conversation.id, extra_headers=keyed(key))
    again = client.conversations.items.with_raw_response.delete(
        item, conversation_id=conversation.id, extra_headers=keyed(key)
    )
    assert replayed(again) and again.parse().model_dump() == first.model_dump()
    assert texts(client.conversations.items.list(conversation.id).data) == ["first 1"]

    key = new_key()
    deleted = client.conversations.delete(conversation.id, extra_headers=keyed(key))
    again_deleted = client.conversations.with_raw_response.delete(conversation.id, extra_headers=keyed(key))
    assert replayed(again_deleted) and again_deleted.parse().model_dump() == deleted.model_dump()
    assert deleted.deleted is True and deleted.id == conversation.id
    with pytest.raises(openai.NotFoundError):
        client.conversations.delete(conversation.id)


def test_a_delete_refused_frees_its_key(client: openai.OpenAI) -> None:
    """A 404 deleted nothing: its key is forgotten, free for the request that was meant."""
    key = new_key()
    with pytest.raises(openai.NotFoundError):
        client.responses.delete("resp_" + "0" * 32, extra_headers=keyed(key))
    made = client.responses.create(model="echo-1", input="the right one")
    client.responses.delete(made.id, extra_headers=keyed(key))


def test_cancel_takes_no_key(client: openai.OpenAI) -> None:
    """Cancelling stores nothing new and a repeat answers the Response as it ended: a key sent is ignored."""
    made = client.responses.create(model="echo-1", input="later", background=True)
    key = new_key()
    first = client.responses.cancel(made.id, extra_headers=keyed(key))
    again = client.responses.with_raw_response.cancel(made.id, extra_headers=keyed(key))
    assert not replayed(again) and again.parse().id == first.id and again.parse().status == first.status


def keys_of(server: StatestoreServer, owner: str, user: str, keys: list[str]) -> list[str]:
    """Which of these keys are kept, as this user's."""
    return [
        key
        for key in keys
        if count(
            server,
            "SELECT count(*) FROM idempotency_keys WHERE owner = :o AND key = :k AND metadata_user_id = :u",
            o=owner,
            k=key,
            u=user,
        )
    ]


def test_keys_of_a_conversation_s_writes_are_erased_with_its_user(
    responses_server: StatestoreServer, api_key: str
) -> None:
    """An append's body names no user, nor a turn's on the conversation that says none: their keys (whose outcomes
    hold what was said) are the conversation's user's, and an erasure of that user takes them with the conversation,
    as it takes the key of the create."""
    user = "user-" + secrets.token_hex(6)
    owner = owner_of(api_key)
    created_key, appended_key, turn_key, removed_key, kept_key = (new_key() for _ in range(5))
    with openai.OpenAI(base_url=responses_server.url + "/v1", api_key=api_key, max_retries=0) as client:
        conversation = client.conversations.create(metadata={"user_id": user}, extra_headers=keyed(created_key))
        client.conversations.items.create(conversation.id, items=ITEMS, extra_headers=keyed(appended_key))
        client.responses.create(
            model="echo-1", input="on it", conversation=conversation.id, extra_headers=keyed(turn_key)
        )
        item = id_of(client.conversations.items.list(conversation.id).data[0])
        client.conversations.items.delete(item, conversation_id=conversation.id, extra_headers=keyed(removed_key))
        someone_else = client.conversations.create(metadata={"user_id": "someone-else"})
        client.conversations.items.create(someone_else.id, items=ITEMS, extra_headers=keyed(kept_key))

        theirs = [created_key, appended_key, turn_key, removed_key]
        assert keys_of(responses_server, owner, user, theirs) == theirs
        assert keys_of(responses_server, owner, "someone-else", [kept_key]) == [kept_key]
        with AdminApi(responses_server.url, ADMIN_TOKEN) as admin:
            admin.erase({"user_id": user})
        assert count(responses_server, "SELECT count(*) FROM idempotency_keys WHERE owner = :o", o=owner) == 1
        assert keys_of(responses_server, owner, "someone-else", [kept_key]) == [kept_key]
        # Nothing of the first outcome is left to replay: the append runs anew, on a conversation that is gone.
        with pytest.raises(openai.NotFoundError):
            client.conversations.items.create(conversation.id, items=ITEMS, extra_headers=keyed(appended_key))


def test_keys_of_a_chain_s_turns_and_compactions_are_erased_with_its_user(
    responses_server: StatestoreServer, api_key: str
) -> None:
    """A turn or a compaction that continues a user's response and names no user of its own is that user's: erased
    with the tree it continues."""
    user = "user-" + secrets.token_hex(6)
    owner = owner_of(api_key)
    turn_key, compact_key = new_key(), new_key()
    with openai.OpenAI(base_url=responses_server.url + "/v1", api_key=api_key, max_retries=0) as client:
        root = client.responses.create(model="echo-1", input="mine", metadata={"user_id": user})
        client.responses.create(
            model="echo-1", input="and more", previous_response_id=root.id, extra_headers=keyed(turn_key)
        )
        client.responses.compact(model="echo-1", previous_response_id=root.id, extra_headers=keyed(compact_key))
        assert keys_of(responses_server, owner, user, [turn_key, compact_key]) == [turn_key, compact_key]
        with AdminApi(responses_server.url, ADMIN_TOKEN) as admin:
            admin.erase({"user_id": user})
        assert keys_of(responses_server, owner, user, [turn_key, compact_key]) == []
        with pytest.raises(openai.BadRequestError):  # run anew: the response it continued is gone
            client.responses.compact(model="echo-1", previous_response_id=root.id, extra_headers=keyed(compact_key))


def test_the_openapi_document_names_the_key_on_every_write(responses_server: StatestoreServer) -> None:
    paths = httpx.get(responses_server.url + "/openapi.json", timeout=10).json()["paths"]
    writes = [
        ("/v1/responses", "post"),
        ("/v1/responses/compact", "post"),
        ("/v1/responses/{response_id}", "delete"),
        ("/v1/conversations", "post"),
        ("/v1/conversations/{conversation_id}", "post"),
        ("/v1/conversations/{conversation_id}", "delete"),
        ("/v1/conversations/{conversation_id}/items", "post"),
        ("/v1/conversations/{conversation_id}/items/{item_id}", "delete"),
        ("/statestore/v1/threads/{thread_id}", "delete"),
    ]
    for path, method in writes:
        names = [p["name"] for p in paths[path][method].get("parameters", [])]
        assert "Idempotency-Key" in names, (path, method)
    cancel = paths["/v1/responses/{response_id}/cancel"]["post"]
    assert "Idempotency-Key" not in [p["name"] for p in cancel.get("parameters", [])]


def lose_outcome(server: StatestoreServer, api_key: str, key: str) -> None:
    """As if the replica that ran the write stopped before it kept the outcome: the key holds only its ids."""

    async def forget() -> None:
        engine = create_async_engine(server.database_url, poolclass=NullPool)
        try:
            async with engine.begin() as conn:
                await conn.execute(
                    text(
                        "UPDATE idempotency_keys SET outcome = NULL, status = NULL, claim_token = 'gone', "
                        "claim_expires_ms = 1 WHERE owner = :o AND key = :k"
                    ),
                    {"o": owner_of(api_key), "k": key},
                )
        finally:
            await engine.dispose()

    asyncio.run(forget())


def test_a_retry_after_an_unkept_outcome_finds_the_write_done(
    client: openai.OpenAI, door: StatestoreServer, api_key: str
) -> None:
    """A create or a delete whose outcome was never kept is not done twice: the retry finds the conversation under
    the id the key named, or the thing deleted, and answers as the first would have."""
    key = new_key()
    before = conversations_of(door, api_key)
    created = client.conversations.create(items=ITEMS, extra_headers=keyed(key))
    lose_outcome(door, api_key, key)
    again = client.conversations.create(items=ITEMS, extra_headers=keyed(key))
    assert again.id == created.id and conversations_of(door, api_key) == before + 1
    assert texts(client.conversations.items.list(created.id, order="asc").data) == ["first 0", "first 1"]

    made = client.responses.create(model="echo-1", input="gone soon")
    key = new_key()
    client.responses.delete(made.id, extra_headers=keyed(key))
    lose_outcome(door, api_key, key)
    deleted = client.responses.with_raw_response.delete(made.id, extra_headers=keyed(key))
    assert deleted.status_code == 200 and replayed(deleted)
    assert deleted.http_response.json() == {"id": made.id, "object": "response.deleted", "deleted": True}
