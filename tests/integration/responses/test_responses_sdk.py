"""`client.responses.*` of the official SDK against statestore: turns, chains, branching, storage and translation,
with the backend's received requests checked exactly."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.integration.responses.conftest import (
    WEATHER,
    Rows,
    chat_requests,
    id_of,
    last_chat_request,
    other_key,
    texts,
)
from tests.support.fake_backend import FakeBackend, chat_action
from tests.support.server import StatestoreServer


def test_a_chain_sends_the_full_translated_history_every_turn(
    any_openai_client: openai.OpenAI, backend: FakeBackend
) -> None:
    openai_client = any_openai_client
    first = openai_client.responses.create(model="echo-1", input="hello", instructions="Be brief.")
    assert first.output_text == "echo: hello"
    assert first.status == "completed" and first.id.startswith("resp_") and id_of(first.output[0]).startswith("msg_")
    second = openai_client.responses.create(model="echo-1", input="again", previous_response_id=first.id)
    third = openai_client.responses.create(
        model="echo-1", input=[{"role": "user", "content": [{"type": "input_text", "text": "third"}]}],
        previous_response_id=second.id, instructions="Be long.",
    )  # fmt: skip
    assert third.output_text == "echo: third" and third.previous_response_id == second.id
    sent = chat_requests(backend)
    assert [r["messages"] for r in sent] == [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}],
        # instructions are not carried over: the second turn has none
        [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "echo: hello"},
            {"role": "user", "content": "again"},
        ],
        [
            {"role": "system", "content": "Be long."},
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "echo: hello"},
            {"role": "user", "content": "again"},
            {"role": "assistant", "content": "echo: again"},
            {"role": "user", "content": "third"},
        ],
    ]
    assert all(r["model"] == "echo-1" and r["stream"] is False for r in sent)
    # the client's credential goes to the backend as a bearer token
    assert last_chat_request(backend).header("authorization") == f"Bearer {openai_client.api_key}"


def test_retrieve_input_items_and_delete(openai_client: openai.OpenAI, backend: FakeBackend) -> None:
    first = openai_client.responses.create(model="echo-1", input="one", metadata={"user_id": "u-1"})
    second = openai_client.responses.create(
        model="echo-1",
        input=[{"role": "user", "content": "two"}, {"role": "developer", "content": "terse"}],
        previous_response_id=first.id,
    )
    retrieved = openai_client.responses.retrieve(second.id)
    assert retrieved.model_dump() == second.model_dump()
    items = openai_client.responses.input_items.list(second.id)
    # this response's own input only, newest first (order=desc by default)
    assert [(i.type, i.model_dump()["role"], text) for i, text in zip(items.data, texts(items.data), strict=True)] == [
        ("message", "developer", "terse"),
        ("message", "user", "two"),
    ]
    ascending = openai_client.responses.input_items.list(second.id, order="asc", limit=1)
    assert texts(ascending.data) == ["two"] and ascending.has_more
    openai_client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as missing:
        openai_client.responses.retrieve(first.id)
    assert missing.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.input_items.list(first.id)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.delete(first.id)
    with pytest.raises(openai.BadRequestError) as gone:
        openai_client.responses.create(model="echo-1", input="x", previous_response_id=first.id)
    assert gone.value.code == "previous_response_not_found"
    # a chain whose ancestor is gone cannot be rebuilt (its cached context went with the deletion)
    with pytest.raises(openai.BadRequestError) as broken:
        openai_client.responses.create(model="echo-1", input="x", previous_response_id=second.id)
    assert broken.value.code == "previous_response_not_found"


def _comparable(response: Any, *, same_turn: bool = False) -> dict[str, Any]:
    dumped: dict[str, Any] = response.model_dump()
    for key in () if same_turn else ("id", "created_at"):
        dumped.pop(key)
    for item in dumped["output"]:
        # the SDK's streaming helper parses into its Parsed* types, which add `parsed` fields
        for key in ("parsed_arguments",) if same_turn else ("id", "call_id", "parsed_arguments"):
            item.pop(key, None)
        for part in item.get("content") or []:
            part.pop("parsed", None)
    return dumped


def test_streamed_and_non_streamed_turns_give_the_same_response(
    openai_client: openai.OpenAI, backend: FakeBackend
) -> None:
    first = openai_client.responses.create(model="echo-1", input="hello there")
    plain = openai_client.responses.create(
        model="echo-1", input="please call get_weather now", previous_response_id=first.id, tools=[WEATHER]
    )
    events: list[Any] = []
    with openai_client.responses.stream(
        model="echo-1", input="please call get_weather now", previous_response_id=first.id, tools=[WEATHER]
    ) as stream:
        for event in stream:
            events.append(event)
            if event.type == "response.completed":
                # sent only after the commit: the response is already retrievable
                assert openai_client.responses.retrieve(event.response.id).status == "completed"
        streamed = stream.get_final_response()
    assert _comparable(streamed) == _comparable(plain)
    assert [o.type for o in streamed.output] == ["message", "function_call"]
    assert streamed.usage is not None and streamed.usage.input_tokens > 0
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.function_call_arguments.delta" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert _comparable(openai_client.responses.retrieve(streamed.id), same_turn=True) == _comparable(
        streamed, same_turn=True
    )
    # the streamed request asked the backend for a stream with usage
    sent = chat_requests(backend)[-1]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}


def test_branching_from_an_older_response(any_openai_client: openai.OpenAI, backend: FakeBackend) -> None:
    openai_client = any_openai_client
    a = openai_client.responses.create(model="echo-1", input="a")
    b = openai_client.responses.create(model="echo-1", input="b", previous_response_id=a.id)
    openai_client.responses.create(model="echo-1", input="c", previous_response_id=b.id)
    backend.reset()
    branch = openai_client.responses.create(model="echo-1", input="b2", previous_response_id=a.id)
    assert chat_requests(backend)[0]["messages"] == [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "echo: a"},
        {"role": "user", "content": "b2"},
    ]
    backend.reset()
    openai_client.responses.create(model="echo-1", input="d", previous_response_id=b.id)  # the older head again
    assert [m["content"] for m in chat_requests(backend)[0]["messages"]] == ["a", "echo: a", "b", "echo: b", "d"]
    assert branch.previous_response_id == a.id


async def test_store_false_stores_nothing(openai_client: openai.OpenAI, rows: Rows, api_key: str) -> None:
    before = await rows.counts(api_key)
    unstored = openai_client.responses.create(model="echo-1", input="secret", store=False)
    assert unstored.model_dump()["store"] is False and unstored.output_text == "echo: secret"
    assert await rows.counts(api_key) == before
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client.responses.create(model="echo-1", input="x", previous_response_id=unstored.id)
    assert refused.value.body == {
        "message": f"Previous response with id '{unstored.id}' not found.",
        "type": "invalid_request_error",
        "param": "previous_response_id",
        "code": "previous_response_not_found",
    }


def test_another_owners_response_is_not_found(openai_client: openai.OpenAI, responses_server: StatestoreServer) -> None:
    mine = openai_client.responses.create(model="echo-1", input="mine")
    with openai.OpenAI(base_url=responses_server.url + "/v1", api_key=other_key(), max_retries=0) as stranger:
        with pytest.raises(openai.BadRequestError) as refused:
            stranger.responses.create(model="echo-1", input="x", previous_response_id=mine.id)
        assert refused.value.code == "previous_response_not_found"
        for attempt in (
            lambda: stranger.responses.retrieve(mine.id),
            lambda: stranger.responses.delete(mine.id),
            lambda: stranger.responses.input_items.list(mine.id),
        ):
            with pytest.raises(openai.NotFoundError):
                attempt()
    assert openai_client.responses.retrieve(mine.id).id == mine.id


def test_function_calls_outputs_images_and_formats_translate(
    openai_client: openai.OpenAI, backend: FakeBackend
) -> None:
    first = openai_client.responses.create(model="echo-1", input="please call get_weather", tools=[WEATHER])
    call = first.output[-1]
    assert call.type == "function_call" and call.name == "get_weather" and id_of(call).startswith("fc_")
    schema: Any = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    user_turn: Any = {
        "role": "user",
        "content": [
            {"type": "input_text", "text": "and this?"},
            {"type": "input_image", "image_url": "https://example.com/a.png", "detail": "low"},
        ],
    }
    second = openai_client.responses.create(
        model="echo-1",
        previous_response_id=first.id,
        input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
            user_turn,
        ],
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        temperature=0.5,
        top_p=0.9,
        max_output_tokens=500,
        text={"format": {"type": "json_schema", "name": "reply", "schema": schema, "strict": True}},
    )
    sent = chat_requests(backend)[-1]
    assert sent["messages"][1:] == [
        {"role": "assistant", "content": "echo: please call get_weather"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "and this?"},
                {"type": "image_url", "image_url": {"url": "https://example.com/a.png", "detail": "low"}},
            ],
        },
    ]
    assert sent["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather for a city",
                "parameters": WEATHER["parameters"],
                "strict": True,
            },
        }
    ]
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert (sent["parallel_tool_calls"], sent["temperature"], sent["top_p"], sent["max_tokens"]) == (
        False,
        0.5,
        0.9,
        500,
    )
    assert sent["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "reply", "schema": schema, "strict": True},
    }
    assert (
        second.tools[0].model_dump()["name"] == "get_weather"
        and second.temperature == 0.5
        and second.max_output_tokens == 500
    )


def test_length_is_incomplete_and_continuable_and_usage_maps(
    openai_client: openai.OpenAI, backend: FakeBackend
) -> None:
    usage = {
        "prompt_tokens": 40,
        "completion_tokens": 7,
        "total_tokens": 47,
        "prompt_tokens_details": {"cached_tokens": 32},
        "completion_tokens_details": {"reasoning_tokens": 3},
    }
    backend.script(chat_action({"role": "assistant", "content": "cut sho"}, finish_reason="length", usage=usage))
    cut = openai_client.responses.create(model="echo-1", input="long answer please", max_output_tokens=2)
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens" and cut.output_text == "cut sho"
    assert cut.usage is not None
    assert (cut.usage.input_tokens, cut.usage.output_tokens, cut.usage.total_tokens) == (40, 7, 47)
    assert cut.usage.input_tokens_details.cached_tokens == 32
    assert cut.usage.output_tokens_details.reasoning_tokens == 3
    backend.script(chat_action({"role": "assistant", "content": "cut sho"}, finish_reason="length", usage=usage))
    with openai_client.responses.stream(model="echo-1", input="again") as stream:
        last = list(stream)[-1]
    # OpenAI ends an incomplete stream with response.incomplete (the SDK's get_final_response wants .completed)
    assert last.type == "response.incomplete" and last.response.status == "incomplete"
    assert openai_client.responses.retrieve(last.response.id).status == "incomplete"
    following = openai_client.responses.create(model="echo-1", input="go on", previous_response_id=cut.id)
    assert [m["content"] for m in chat_requests(backend)[-1]["messages"]] == ["long answer please", "cut sho", "go on"]
    assert following.status == "completed"


def test_backend_errors_are_relayed_with_their_status(
    openai_client: openai.OpenAI, backend: FakeBackend, rows: Rows
) -> None:
    backend.script(
        {
            "kind": "error",
            "path": "/v1/chat/completions",
            "status": 429,
            "error": {"message": "Slow down", "type": "rate_limit_error", "code": "rate_limit"},
        }
    )
    with pytest.raises(openai.RateLimitError) as limited:
        openai_client.responses.create(model="echo-1", input="x")
    assert limited.value.body == {
        "message": "Slow down",
        "type": "rate_limit_error",
        "param": None,
        "code": "rate_limit",
    }


def test_the_backend_request_is_one_valid_json_document(openai_client: openai.OpenAI, backend: FakeBackend) -> None:
    openai_client.responses.create(model="echo-1", input='quote " and \\ and \u2028 unicode ✓')
    body = last_chat_request(backend).body
    assert orjson.loads(body)["messages"][-1]["content"] == 'quote " and \\ and \u2028 unicode ✓'


def test_the_openapi_document_lists_the_routes(responses_server: StatestoreServer) -> None:
    paths = httpx.get(responses_server.url + "/openapi.json", timeout=10).json()["paths"]
    assert {"post"} <= set(paths["/v1/responses"]) and {"get", "delete"} <= set(paths["/v1/responses/{response_id}"])
    assert "/v1/responses/{response_id}/input_items" in paths
    assert {"get", "post", "delete"} <= set(paths["/v1/conversations/{conversation_id}"])
    assert {"get", "post"} <= set(paths["/v1/conversations/{conversation_id}/items"])
    assert {"get", "delete"} <= set(paths["/v1/conversations/{conversation_id}/items/{item_id}"])
