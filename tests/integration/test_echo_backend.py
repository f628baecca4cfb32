"""The echo backend as a real process, driven by the official SDK: replies, streams, tools, thinking, errors."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import orjson
import pytest
from anthropic.types import MessageParam, ToolParam

from tests.support.fake_backend import BackendProcess

REPO = Path(__file__).resolve().parents[2]
WEATHER_TOOL: ToolParam = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "days", "unit"],
    },
}


@pytest.fixture(scope="module")
def echo_url() -> Iterator[str]:
    with BackendProcess("--echo") as backend:
        yield backend.url


@pytest.fixture
def client(echo_url: str) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=echo_url, api_key="test", max_retries=0) as sdk:
        yield sdk


def user(text: str) -> list[MessageParam]:
    return [{"role": "user", "content": text}]


def tokens(value: Any) -> int:
    return math.ceil(len(orjson.dumps(value)) / 4)


def test_json_reply_echoes_the_last_user_text(client: anthropic.Anthropic) -> None:
    messages: list[MessageParam] = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "echo: first"},
        {"role": "user", "content": [{"type": "text", "text": "héllo"}, {"type": "text", "text": "world"}]},
    ]
    raw = client.messages.with_raw_response.create(model="any-model", max_tokens=100, messages=messages)
    reply = raw.parse()

    assert raw.headers["request-id"].startswith("req_01")
    assert reply.id.startswith("msg_01") and len(reply.id) == 28
    assert reply.model == "any-model"
    assert [block.model_dump(exclude_none=True) for block in reply.content] == [
        {"type": "text", "text": "echo: héllo\nworld"}
    ]
    assert reply.stop_reason == "end_turn"
    assert reply.stop_sequence is None
    assert reply.usage.input_tokens == tokens(messages)
    assert reply.usage.output_tokens == math.ceil(len("echo: héllo\nworld".encode()) / 4)
    assert reply.usage.cache_read_input_tokens == 0


def test_stream_gives_the_json_reply_in_several_deltas(client: anthropic.Anthropic) -> None:
    text = "the quick brown fox jumps over the lazy dog and keeps on running far away"
    args: dict[str, Any] = {
        "model": "echo-1",
        "max_tokens": 4000,
        "messages": user(f"{text}, please call get_weather"),
        "tools": [WEATHER_TOOL],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    }
    reply = client.messages.create(**args)
    with client.messages.stream(**args) as stream:
        streamed = stream.get_final_message()
    assert streamed.id != reply.id
    assert streamed.model_dump(exclude={"id"}) == reply.model_dump(exclude={"id"})
    assert [block.type for block in streamed.content] == ["thinking", "text", "tool_use"]

    beta_reply = client.beta.messages.create(**args)
    with client.beta.messages.stream(**args) as beta_stream:
        beta_streamed = beta_stream.get_final_message()
    assert beta_streamed.model_dump(exclude={"id"}) == beta_reply.model_dump(exclude={"id"})

    events = list(client.messages.create(**args, stream=True))
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    deltas = [event.delta.type for event in events if event.type == "content_block_delta"]
    assert deltas.count("text_delta") > 3
    assert deltas.count("signature_delta") == 1
    assert deltas.count("input_json_delta") > 1
    start = events[0]
    assert start.type == "message_start"
    assert start.message.content == [] and start.message.stop_reason is None


def test_tool_use_trigger(client: anthropic.Anthropic) -> None:
    said = "please call get_weather for Paris"
    first = client.messages.create(model="echo-1", max_tokens=500, messages=user(said), tools=[WEATHER_TOOL])
    again = client.messages.create(model="echo-1", max_tokens=500, messages=user(said), tools=[WEATHER_TOOL])

    assert first.stop_reason == "tool_use"
    text, tool = first.content
    assert text.type == "text" and text.text == f"echo: {said}"
    assert tool.type == "tool_use"
    assert tool.name == "get_weather"
    assert tool.input == {"city": said, "days": 1, "unit": "c"}
    assert tool.id.startswith("toolu_01")
    assert again.content[1].model_dump() == tool.model_dump()

    plain = client.messages.create(model="echo-1", max_tokens=500, messages=user("hello"), tools=[WEATHER_TOOL])
    assert plain.stop_reason == "end_turn" and len(plain.content) == 1
    forced = client.messages.create(
        model="echo-1", max_tokens=500, messages=user("hello"), tools=[WEATHER_TOOL], tool_choice={"type": "any"}
    )
    assert forced.stop_reason == "tool_use" and forced.content[-1].type == "tool_use"
    refused = client.messages.create(
        model="echo-1", max_tokens=500, messages=user(said), tools=[WEATHER_TOOL], tool_choice={"type": "none"}
    )
    assert refused.stop_reason == "end_turn"


def test_turns_without_text_get_a_deterministic_description(client: anthropic.Anthropic) -> None:
    messages: list[MessageParam] = [
        {"role": "user", "content": "call get_weather"},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {}},
                {"type": "tool_use", "id": "toolu_b", "name": "get_weather", "input": {}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_a", "content": "sunny"},
                {"type": "tool_result", "tool_use_id": "toolu_b", "content": "rainy"},
            ],
        },
    ]
    reply = client.messages.create(model="echo-1", max_tokens=100, messages=messages, tools=[WEATHER_TOOL])
    assert reply.stop_reason == "end_turn"
    assert reply.content[0].type == "text" and reply.content[0].text == "echo: (2 tool results)"

    paused: list[MessageParam] = [{"role": "user", "content": "go on"}, {"role": "assistant", "content": "partial"}]
    reply = client.messages.create(model="echo-1", max_tokens=100, messages=paused)
    assert reply.content[0].type == "text" and reply.content[0].text == "echo: (continuing)"


def test_thinking_block_with_signature(client: anthropic.Anthropic) -> None:
    reply = client.messages.create(
        model="echo-1", max_tokens=2000, messages=user("think"), thinking={"type": "enabled", "budget_tokens": 1024}
    )
    thinking = reply.content[0]
    assert thinking.type == "thinking"
    assert thinking.thinking == "The user turn has 5 characters; echo it."
    assert len(thinking.signature) == 44
    same = client.messages.create(
        model="echo-1", max_tokens=2000, messages=user("think"), thinking={"type": "adaptive"}
    ).content[0]
    assert same.type == "thinking" and same.signature == thinking.signature

    omitted = client.messages.create(
        model="echo-1", max_tokens=2000, messages=user("think"), thinking={"type": "adaptive", "display": "omitted"}
    ).content[0]
    assert omitted.type == "thinking" and omitted.thinking == "" and omitted.signature
    assert omitted.signature != thinking.signature


def test_max_tokens_and_stop_sequences(client: anthropic.Anthropic) -> None:
    cut = client.messages.create(model="echo-1", max_tokens=3, messages=user("a rather long sentence"))
    assert cut.stop_reason == "max_tokens"
    assert cut.content[0].type == "text" and cut.content[0].text == "echo: a rath"
    assert cut.usage.output_tokens == 3

    stopped = client.messages.create(
        model="echo-1", max_tokens=100, messages=user("one two STOP three"), stop_sequences=["three", "STOP"]
    )
    assert stopped.stop_reason == "stop_sequence"
    assert stopped.stop_sequence == "STOP"
    assert stopped.content[0].type == "text" and stopped.content[0].text == "echo: one two "


def test_count_tokens_matches_the_reply_usage(client: anthropic.Anthropic) -> None:
    messages = user("count me, please")
    counted = client.messages.count_tokens(model="echo-1", messages=messages, system="be brief", tools=[WEATHER_TOOL])
    reply = client.messages.create(
        model="echo-1", max_tokens=100, messages=messages, system="be brief", tools=[WEATHER_TOOL]
    )
    expected = math.ceil(sum(len(orjson.dumps(v)) for v in ("be brief", [WEATHER_TOOL], messages)) / 4)
    assert counted.input_tokens == expected == reply.usage.input_tokens


def test_models(client: anthropic.Anthropic) -> None:
    page = client.models.list()
    assert [model.id for model in page.data] == ["echo-1"]
    assert page.has_more is False and page.first_id == page.last_id == "echo-1"
    model = client.models.retrieve("echo-1")
    assert model.display_name == "Echo" and model.created_at.year == 2026
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.models.retrieve("claude-nope")
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "model: claude-nope"},
        "request_id": caught.value.request_id,
    }


def test_bad_requests_are_400_in_the_api_shape(client: anthropic.Anthropic, echo_url: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="echo-1", max_tokens=0, messages=user("x"))
    assert caught.value.request_id is not None and caught.value.request_id.startswith("req_")

    for body, message in [
        (b'{"model": "m", "messages": []', "not valid JSON"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}', "max_tokens: Field required"),
        (b'{"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}', "model: Field required"),
        (b'{"model": "m", "max_tokens": 5}', "messages: Field required"),
        (b'{"model": "m", "max_tokens": 5, "messages": []}', "at least one message"),
    ]:
        response = httpx.post(f"{echo_url}/v1/messages", content=body)
        assert response.status_code == 400, body
        assert response.headers["request-id"].startswith("req_")
        error = response.json()
        assert error["type"] == "error" and error["request_id"] == response.headers["request-id"]
        assert error["error"]["type"] == "invalid_request_error"
        assert message in error["error"]["message"]

    missing = httpx.get(f"{echo_url}/v1/nothing")
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "not_found_error"
    assert missing.headers["request-id"].startswith("req_")


def test_benchmark_knobs_pad_and_delay() -> None:
    with (
        BackendProcess("--echo", "--reply-bytes", "3000", "--delay-seconds", "0.3") as backend,
        anthropic.Anthropic(base_url=backend.url, api_key="test", max_retries=0) as sdk,
    ):
        started = time.monotonic()
        reply = sdk.messages.create(model="echo-1", max_tokens=5000, messages=user("pad me"))
        assert time.monotonic() - started >= 0.29
        assert reply.content[0].type == "text"
        assert reply.content[0].text.startswith("echo: pad me lorem ipsum")
        assert len(reply.content[0].text) == 3000
        started = time.monotonic()
        with sdk.messages.stream(model="echo-1", max_tokens=5000, messages=user("pad me")) as stream:
            assert stream.get_final_text() == reply.content[0].text
        # Timers may fire a millisecond early.
        assert time.monotonic() - started >= 0.29


def test_run_echo_backend_serves_on_the_given_port() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = f"from statestore.upstream.echo import run_echo_backend; run_echo_backend('127.0.0.1', {port})"
    process = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 10
        with httpx.Client(timeout=1) as client:  # one for every attempt: a new one loads the CA bundle each time
            while True:
                try:
                    response = client.get(f"http://127.0.0.1:{port}/v1/models")
                    break
                except httpx.TransportError:
                    assert process.poll() is None and time.monotonic() < deadline
                    time.sleep(0.02)
        assert response.json()["data"][0]["id"] == "echo-1"
    finally:
        process.terminate()
        process.wait(timeout=5)
