"""The echo backend's Chat Completions endpoint through the official `openai` SDK: JSON and SSE give the same reply,
a tool call on request, `max_tokens` → `length`, honest usage, and strict refusals."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import openai
import orjson
import pytest

from tests.support.fake_backend import BackendProcess

WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
}


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    with (
        BackendProcess("--echo") as backend,
        openai.OpenAI(base_url=backend.url + "/v1", api_key="test", max_retries=0) as sdk,
    ):
        yield sdk


def test_json_and_stream_give_the_same_reply_with_honest_usage(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "system", "content": "s"}, {"role": "user", "content": "hello there"}]
    reply = client.chat.completions.create(model="echo-1", messages=messages)
    assert reply.choices[0].message.content == "echo: hello there" and reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == math.ceil((len(orjson.dumps(messages)) + 2) / 4)
    assert reply.usage.completion_tokens == math.ceil(len("echo: hello there") / 4)
    chunks = list(
        client.chat.completions.create(
            model="echo-1", messages=messages, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "echo: hello there" and len(chunks) > 3
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == reply.usage.total_tokens


def test_a_tool_call_on_request_and_length(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="echo-1", messages=[{"role": "user", "content": "please call get_weather"}], tools=[WEATHER]
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls is not None
    call: Any = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert orjson.loads(call.function.arguments) == {"city": "please call get_weather", "days": 1}
    cut = client.chat.completions.create(
        model="echo-1", messages=[{"role": "user", "content": "x" * 100}], max_tokens=2
    )
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content == "echo: xx"


def test_a_malformed_request_is_refused(client: openai.OpenAI) -> None:
    for messages in ([{"role": "wizard", "content": "x"}], [{"role": "tool", "content": "x"}], []):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="echo-1", messages=messages)  # type: ignore[arg-type]
