"""The scriptable fake backend as a real process: recording, scripted replies and failures, seen through the SDK."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import httpx2
import orjson
import pytest
from anthropic.types import MessageParam
from anthropic.types.beta import BetaMessageParam

from tests.support.fake_backend import FakeBackend, error_action, message_action

HELLO: list[MessageParam] = [{"role": "user", "content": "hello"}]
RICH_CONTENT: list[dict[str, Any]] = [
    {"type": "thinking", "thinking": "Let me search the web for that, then answer.", "signature": "c2lnbmF0dXJl"},
    {"type": "server_tool_use", "id": "srvtoolu_01", "name": "web_search", "input": {"query": "weather, Paris: today"}},
    {
        "type": "web_search_tool_result",
        "tool_use_id": "srvtoolu_01",
        "content": [
            {
                "type": "web_search_result",
                "url": "https://example.com",
                "title": "Example",
                "encrypted_content": "ZW5j",
                "page_age": None,
            }
        ],
    },
    {
        "type": "text",
        "text": "It is sunny in Paris today, say the forecasts.",
        "citations": [
            {
                "type": "web_search_result_location",
                "url": "https://example.com",
                "title": "Example",
                "encrypted_index": "aWR4",
                "cited_text": "sunny",
            }
        ],
    },
    {"type": "compaction", "content": "summary of the earlier turns", "encrypted_content": None},
    {"type": "tool_use", "id": "toolu_01", "name": "lookup", "input": {"a": [1, {"b": 'c,d:"e\\n'}], "z": "é"}},
]
FALLBACK_USAGE: dict[str, Any] = {
    "input_tokens": 40,
    "cache_creation_input_tokens": 0,
    "cache_read_input_tokens": 7,
    "output_tokens": 90,
    "iterations": [
        {"type": "message", "input_tokens": 20, "output_tokens": 45},
        {"type": "fallback_message", "input_tokens": 20, "output_tokens": 45},
    ],
}


@pytest.fixture
def client(backend: FakeBackend) -> Iterator[anthropic.Anthropic]:
    """The SDK straight at the fake backend (the session's process, reset: tests/integration/conftest.py)."""
    with anthropic.Anthropic(base_url=backend.url, api_key="test", max_retries=0) as sdk:
        yield sdk


def test_unscripted_replies_echo_and_every_request_is_recorded_byte_for_byte(
    backend: FakeBackend, client: anthropic.Anthropic
) -> None:
    reply = client.messages.create(model="claude-test", max_tokens=50, messages=HELLO)
    assert reply.content[0].type == "text" and reply.content[0].text == "echo: hello"

    odd = '{ "model":"m",\n "max_tokens": 5, "messages": [{"role":"user","content":"h\\u00e9 \u2603"}] }'.encode()
    response = httpx.post(f"{backend.url}/v1/messages?beta=true&x=%20y", content=odd, headers={"X-Custom": "Value 1"})
    assert response.status_code == 200
    assert response.json()["content"][0]["text"] == "echo: hé \u2603"

    first, second = backend.requests()
    assert first.method == "POST" and first.path == "/v1/messages"
    assert orjson.loads(first.body) == {"max_tokens": 50, "messages": HELLO, "model": "claude-test"}
    assert first.header("Anthropic-Version") is not None
    assert second.body == odd
    assert second.query == "beta=true&x=%20y"
    assert second.header("x-custom") == "Value 1"


def test_scripted_errors_reach_the_sdk_as_its_exceptions(backend: FakeBackend, client: anthropic.Anthropic) -> None:
    backend.script(
        error_action(529, "overloaded_error", "Overloaded"),
        error_action(429, "rate_limit_error", "Slow down", headers={"retry-after": "7"}),
        error_action(500, "api_error", "Internal server error"),
    )
    assert backend.pending() == 3
    with pytest.raises(anthropic.OverloadedError) as overloaded:
        client.messages.create(model="m", max_tokens=5, messages=HELLO)
    assert overloaded.value.body == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "Overloaded"},
        "request_id": overloaded.value.request_id,
    }
    with pytest.raises(anthropic.RateLimitError) as limited:
        client.messages.create(model="m", max_tokens=5, messages=HELLO)
    assert limited.value.response.headers["retry-after"] == "7"
    with pytest.raises(anthropic.InternalServerError):
        client.messages.create(model="m", max_tokens=5, stream=True, messages=HELLO)
    assert backend.pending() == 0
    assert client.messages.create(model="m", max_tokens=5, messages=HELLO).stop_reason == "end_turn"


def test_a_scripted_message_is_the_same_through_json_and_stream(
    backend: FakeBackend, client: anthropic.Anthropic
) -> None:
    scripted = message_action(RICH_CONTENT, stop_reason="pause_turn", usage=FALLBACK_USAGE, model="served-model")
    backend.script(scripted, scripted)
    hello: list[BetaMessageParam] = [{"role": "user", "content": "hello"}]
    as_json = client.beta.messages.create(model="asked-model", max_tokens=500, messages=hello)
    with client.beta.messages.stream(model="asked-model", max_tokens=500, messages=hello) as stream:
        as_stream = stream.get_final_message()

    assert as_json.model_dump(exclude={"id"}) == as_stream.model_dump(exclude={"id"})
    assert as_json.model == "served-model"
    assert as_json.stop_reason == "pause_turn"
    assert [block.to_dict() for block in as_stream.content] == RICH_CONTENT
    assert as_stream.usage.iterations is not None
    assert [entry.type for entry in as_stream.usage.iterations] == ["message", "fallback_message"]
    assert as_stream.usage.cache_read_input_tokens == 7


def test_a_refusal_keeps_its_stop_reason(backend: FakeBackend, client: anthropic.Anthropic) -> None:
    content = [{"type": "text", "text": "I can't help with that."}]
    backend.script(message_action(content, stop_reason="refusal"))
    with client.messages.stream(model="m", max_tokens=50, messages=HELLO) as stream:
        refused = stream.get_final_message()
    assert refused.stop_reason == "refusal"
    assert refused.usage.output_tokens == math.ceil(len(orjson.dumps(content)) / 4)  # the scripted default


def test_a_cut_stream_breaks_the_sdk_and_json_cuts_too(backend: FakeBackend, client: anthropic.Anthropic) -> None:
    backend.script({"kind": "echo", "cut_after_events": 4})
    with httpx.stream(
        "POST", f"{backend.url}/v1/messages", json={"model": "m", "max_tokens": 9, "messages": HELLO, "stream": True}
    ) as response:
        received = b""
        with pytest.raises(httpx.RemoteProtocolError):
            for chunk in response.iter_bytes():
                received += chunk
    assert received.count(b"\n\n") == 4 and b"message_stop" not in received

    backend.script({"kind": "echo", "cut_after_events": 4})
    with (
        pytest.raises(httpx2.RemoteProtocolError),
        client.messages.stream(model="m", max_tokens=50, messages=HELLO) as stream,
    ):
        stream.get_final_message()

    backend.script({"kind": "echo", "cut_after_events": 1}, {"kind": "close"})
    with pytest.raises(anthropic.APIConnectionError):
        client.messages.create(model="m", max_tokens=50, messages=HELLO)
    with pytest.raises(anthropic.APIConnectionError):
        client.messages.create(model="m", max_tokens=50, messages=HELLO)
    assert len(backend.requests()) == 4


def test_stalls_delays_and_error_events(backend: FakeBackend, client: anthropic.Anthropic) -> None:
    backend.script({"kind": "echo", "stall_after_events": 3, "stall_seconds": 1.0})
    impatient = client.with_options(timeout=0.3)
    with (
        pytest.raises(httpx2.ReadTimeout),
        impatient.messages.stream(model="m", max_tokens=50, messages=HELLO) as stream,
    ):
        stream.get_final_message()

    backend.script({"kind": "echo", "delay_seconds": 0.2})
    started = time.monotonic()
    assert client.messages.create(model="m", max_tokens=50, messages=HELLO).content
    assert time.monotonic() - started >= 0.2

    failure = {"type": "overloaded_error", "message": "Overloaded"}
    backend.script({"kind": "echo", "error_after_events": 3, "error": failure})
    with (
        pytest.raises(anthropic.APIStatusError) as caught,
        client.messages.stream(model="m", max_tokens=50, messages=HELLO) as stream,
    ):
        stream.get_final_message()
    assert isinstance(caught.value.body, dict) and caught.value.body["error"] == failure


def test_invalid_scripts_are_refused(backend: FakeBackend) -> None:
    with pytest.raises(ValueError, match="unknown kind"):
        backend.script({"kind": "explode"})
    with pytest.raises(ValueError, match="error object"):
        backend.script({"kind": "error", "status": 500})
    assert backend.pending() == 0
