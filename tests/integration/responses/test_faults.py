"""A turn that does not complete stores nothing: a backend stream cut short, a backend error, a client that leaves;
hostile inputs get a 4xx in OpenAI's shape and store nothing."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest

from tests.integration.responses.conftest import Rows, chat_requests
from tests.support.fake_backend import FakeBackend
from tests.support.server import StatestoreServer

CHAT = "/v1/chat/completions"


async def test_a_cut_backend_stream_stores_nothing(
    openai_client: openai.OpenAI, backend: FakeBackend, rows: Rows, api_key: str
) -> None:
    conversation = openai_client.conversations.create()
    head = openai_client.responses.create(model="echo-1", input="start")
    before = await rows.counts(api_key)
    for cut in (0, 1, 3, 5):
        for where in ({"previous_response_id": head.id}, {"conversation": conversation.id}):
            backend.script({"kind": "echo", "path": CHAT, "cut_after_events": cut})
            stream = openai_client.responses.stream(model="echo-1", input="say a few more words", extra_body=where)
            with pytest.raises(openai.APIConnectionError), stream as events:
                list(events)
    for action in ({"kind": "echo", "path": CHAT, "cut_after_bytes": 20}, {"kind": "close", "path": CHAT}):
        for where in ({"previous_response_id": head.id}, {"conversation": conversation.id}):
            backend.script(action)
            with pytest.raises(openai.APIError):
                openai_client.responses.create(model="echo-1", input="x", extra_body=where)
    assert await rows.counts(api_key) == before
    # the conversation was given back every time: the next turn goes through
    assert (
        openai_client.responses.create(model="echo-1", input="ok", conversation=conversation.id).output_text
        == "echo: ok"
    )


async def test_a_client_that_leaves_stores_nothing(
    async_openai_client: openai.AsyncOpenAI, backend: FakeBackend, rows: Rows, api_key: str
) -> None:
    client = async_openai_client
    conversation = await client.conversations.create()
    before = await rows.counts(api_key)
    backend.script({"kind": "echo", "path": CHAT, "stall_after_events": 2, "stall_seconds": 1.0})
    async with client.responses.stream(model="echo-1", input="hello there", conversation=conversation.id) as stream:
        async for event in stream:
            if event.type == "response.output_text.delta":
                break  # leave mid-reply
    # once statestore notices, it gives the conversation back without storing anything
    while True:
        try:
            await client.conversations.items.create(conversation.id, items=[{"role": "user", "content": "back"}])
            break
        except openai.BadRequestError as exc:
            assert exc.code == "conversation_locked"
            await asyncio.sleep(0.05)
    after = await rows.counts(api_key)
    assert after == {**before, "conversation_items": before["conversation_items"] + 1}


HOSTILE: list[tuple[Any, int, str | None]] = [
    ({"model": "echo-1", "input": [{"type": "telepathy_call", "id": "x"}]}, 400, "input[0]"),
    ({"model": "echo-1", "input": [{"type": "item_reference", "id": "msg_x"}]}, 400, "input[0]"),
    ({"model": "echo-1", "input": [{"type": "shell_call", "id": 7}]}, 400, "input[0]"),
    ({"model": "echo-1", "input": [{"role": "wizard", "content": "hi"}]}, 400, "input[0].role"),
    (
        {"model": "echo-1", "input": [{"role": "user", "content": [{"type": "input_audio"}]}]},
        400,
        "input[0].content[0]",
    ),
    (
        {"model": "echo-1", "input": [{"type": "function_call", "call_id": 5, "name": "f", "arguments": "{}"}]},
        400,
        "input[0].call_id",
    ),
    ({"model": "echo-1", "input": 42}, 400, "input"),
    ({"model": "echo-1"}, 400, "input"),
    ({"input": "hi"}, 400, "model"),
    ({"model": "echo-1", "input": "hi", "surprise": 1}, 400, "surprise"),
    ({"model": "echo-1", "input": "hi", "previous_response_id": "../../etc/passwd"}, 400, "previous_response_id"),
    ({"model": "echo-1", "input": "hi", "previous_response_id": "resp_" + "A" * 5000}, 400, "previous_response_id"),
    ({"model": "echo-1", "input": "hi", "previous_response_id": 7}, 400, "previous_response_id"),
    ({"model": "echo-1", "input": "hi", "conversation": "conv_\u0000"}, 404, "conversation"),
    ({"model": "echo-1", "input": "hi", "conversation": {"id": 3}}, 400, "conversation"),
    ({"model": "echo-1", "input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools[0]"),
    ({"model": "echo-1", "input": "hi", "temperature": 9}, 400, "temperature"),
    ({"model": "echo-1", "input": "hi", "metadata": {"k": 1}}, 400, "metadata"),
    ({"model": "echo-1", "input": "hi", "text": {"format": {"type": "json_schema"}}}, 400, "text.format"),
    ({"model": "echo-1", "input": "x" * (11 * 1024 * 1024)}, 400, "input"),
]


async def test_hostile_inputs_are_refused_in_openais_shape(
    responses_server: StatestoreServer, backend: FakeBackend, rows: Rows, api_key: str
) -> None:
    before = await rows.counts(api_key)
    headers = {"authorization": f"Bearer {api_key}"}
    async with httpx.AsyncClient(base_url=responses_server.url, headers=headers, timeout=60) as http:
        for body, status, param in HOSTILE:
            answer = await http.post("/v1/responses", json=body)
            assert answer.status_code == status, (param, answer.text)
            error = answer.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
            assert error["type"] == "invalid_request_error"
        for raw in (b"{not json", b"[1, 2]", b'"text"'):
            answer = await http.post("/v1/responses", content=raw, headers={"content-type": "application/json"})
            assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error"
        huge = await http.post("/v1/responses", content=b"x" * (33 * 1024 * 1024))
        assert huge.status_code == 413 and set(huge.json()["error"]) == {"message", "type", "param", "code"}
        for path in (
            "/v1/responses/resp_nope",
            "/v1/responses/%00",
            "/v1/responses/resp_x/input_items",
            "/v1/conversations/conv_x",
        ):
            answer = await http.get(path)
            assert answer.status_code == 404 and answer.json()["error"]["type"] == "invalid_request_error", path
        anonymous = await http.post(
            "/v1/responses", json={"model": "echo-1", "input": "hi"}, headers={"authorization": ""}
        )
        assert anonymous.status_code == 401 and set(anonymous.json()["error"]) == {"message", "type", "param", "code"}
    assert chat_requests(backend) == []
    assert await rows.counts(api_key) == before


async def test_a_value_the_database_cannot_hold_is_the_requests_fault(
    responses_server: StatestoreServer, rows: Rows, api_key: str
) -> None:
    """PostgreSQL text holds no NUL: the commit's prepared statement refuses it, and the turn is a 400, not a 503."""
    headers = {"authorization": f"Bearer {api_key}"}
    body = {"model": "echo-1", "input": "hi", "metadata": {"user_id": "a\u0000b"}}
    async with httpx.AsyncClient(base_url=responses_server.url, headers=headers, timeout=60) as http:
        answer = await http.post("/v1/responses", json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["type"] == "invalid_request_error"
    assert (await rows.counts(api_key))["responses"] == 0


@pytest.mark.parametrize("where", ["continue", "conversation", "append"])
def test_a_value_the_database_cannot_hold_is_refused_before_any_settling(
    any_openai_client: openai.OpenAI, request: pytest.FixtureRequest, where: str
) -> None:
    """A commit the database refuses for a value of the request (a NUL in text, on PostgreSQL) is a 400 on each
    commit path, never the 503 of a commit whose answer was lost (which would be settled): nothing is stored and the
    conversation is free. SQLite holds the value: there the same requests are stored, once."""
    client = any_openai_client
    postgres = request.node.callspec.params["any_openai_client"] == "postgres"
    conversation = client.conversations.create(items=[{"type": "message", "role": "user", "content": "zero"}])
    head = client.responses.create(model="echo-1", input="one")
    nul = {"user_id": "a\u0000b"}
    try:
        if where == "append":
            item = {"type": "message", "id": "msg_a\u0000b", "role": "user", "content": "two"}
            client.conversations.items.create(conversation.id, items=[item])  # type: ignore[list-item]
        elif where == "continue":
            client.responses.create(model="echo-1", input="two", metadata=nul, previous_response_id=head.id)
        else:
            client.responses.create(model="echo-1", input="two", metadata=nul, conversation=conversation.id)
        stored = True
    except openai.BadRequestError as exc:
        assert exc.status_code == 400, exc
        stored = False
    assert stored is not postgres
    items = client.conversations.items.list(conversation.id, order="asc").data
    added = {"continue": 0, "conversation": 2, "append": 1}[where] if stored else 0
    assert len(items) == 1 + added
    # the conversation was given back: the next turn goes through
    after = client.responses.create(model="echo-1", input="ok", conversation=conversation.id)
    assert after.output_text == "echo: ok"
