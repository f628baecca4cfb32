"""The Responses door against llama.cpp's `/v1/chat/completions`: chains, streams and conversations through the `openai`
SDK, each turn's translated request beside the same messages sent straight to the server, usage as the server counted
it, and `truncation: "auto"` against its real 2,048-token window, the server's own refusal included (docs/protocol.md
§9)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response

from tests.realbackend.conftest import NARROW, Stack
from tests.realbackend.llama import MODEL_NAME
from tests.realbackend.test_long_context import words

MAX_OUTPUT = 8


def chat(stack: Stack, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The same turn as a stateless client sends it to the server itself."""
    response = httpx.post(
        f"{stack.llama.url}/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": messages, "max_tokens": MAX_OUTPUT},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    value: dict[str, Any] = response.json()
    return value


def test_a_chain_sends_what_a_stateless_client_would_and_counts_what_the_server_counted(
    gpt: openai.OpenAI, stack: Stack
) -> None:
    first = gpt.responses.create(model=MODEL_NAME, input="Hello there.", instructions="Be brief.", max_output_tokens=8)
    second = gpt.responses.create(
        model=MODEL_NAME, input="And again.", previous_response_id=first.id, max_output_tokens=MAX_OUTPUT
    )
    third = gpt.responses.create(
        model=MODEL_NAME, input="Once more.", previous_response_id=second.id, max_output_tokens=MAX_OUTPUT
    )
    # A previous response's instructions are not carried over (OpenAI's rule): the third turn has none.
    direct = chat(
        stack,
        [
            {"role": "user", "content": "Hello there."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And again."},
            {"role": "assistant", "content": second.output_text},
            {"role": "user", "content": "Once more."},
        ],
    )
    assert third.output_text == direct["choices"][0]["message"]["content"]
    assert third.usage is not None
    assert third.usage.input_tokens == direct["usage"]["prompt_tokens"]
    assert third.usage.output_tokens == direct["usage"]["completion_tokens"] == MAX_OUTPUT
    assert third.usage.total_tokens == third.usage.input_tokens + third.usage.output_tokens
    # The server's prompt cache held the chain's prefix: cached_tokens came through from prompt_tokens_details.
    assert third.usage.input_tokens_details.cached_tokens > 0
    assert third.status == "incomplete" and third.incomplete_details is not None
    assert third.incomplete_details.reason == "max_output_tokens"


def test_a_streamed_turn_ends_as_the_same_response_the_server_would_give(gpt: openai.OpenAI) -> None:
    first = gpt.responses.create(model=MODEL_NAME, input="Stream after me.", max_output_tokens=MAX_OUTPUT)
    plain = gpt.responses.create(
        model=MODEL_NAME, input="Go on.", previous_response_id=first.id, max_output_tokens=MAX_OUTPUT
    )
    deltas: list[str] = []
    ended: Response | None = None
    with gpt.responses.stream(
        model=MODEL_NAME, input="Go on.", previous_response_id=first.id, max_output_tokens=MAX_OUTPUT
    ) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            # Cut at max_output_tokens (llama.cpp's finish_reason "length"), the stream ends in response.incomplete,
            # as OpenAI's does; the SDK's get_final_response() waits for response.completed only.
            if event.type == "response.incomplete":
                ended = event.response
    assert ended is not None and ended.status == "incomplete"
    streamed = ended
    assert "".join(deltas) == streamed.output_text == plain.output_text
    assert streamed.usage is not None and plain.usage is not None
    # llama.cpp sends usage only when asked (stream_options.include_usage, which the door sets).
    assert streamed.usage.input_tokens == plain.usage.input_tokens
    assert streamed.usage.output_tokens == plain.usage.output_tokens == MAX_OUTPUT
    follow = gpt.responses.create(
        model=MODEL_NAME, input="After the stream.", previous_response_id=streamed.id, max_output_tokens=MAX_OUTPUT
    )
    assert follow.usage is not None and follow.usage.input_tokens > streamed.usage.input_tokens


def test_a_conversation_keeps_its_items_across_turns(gpt: openai.OpenAI) -> None:
    conversation = gpt.conversations.create()
    first = gpt.responses.create(
        model=MODEL_NAME, input="First in the conversation.", conversation=conversation.id, max_output_tokens=8
    )
    second = gpt.responses.create(
        model=MODEL_NAME, input="Second.", conversation=conversation.id, max_output_tokens=MAX_OUTPUT
    )
    assert first.usage is not None and second.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    items = gpt.conversations.items.list(conversation.id, order="asc")
    texts = [item.content[0].text for item in items.data if item.type == "message"]  # type: ignore[union-attr]
    assert texts == ["First in the conversation.", first.output_text, "Second.", second.output_text]


@pytest.fixture
def narrow_gpt(narrow_stack: Stack, api_key: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=narrow_stack.statestore.url + "/v1", api_key=api_key, max_retries=0, timeout=120
    ) as sdk:
        yield sdk


def _long_chain(sdk: openai.OpenAI, turns: int, **fields: Any) -> list[tuple[Response, str | None]]:
    previous: str | None = None
    sent: list[tuple[Response, str | None]] = []
    for turn in range(turns):
        raw = sdk.responses.with_raw_response.create(
            model=MODEL_NAME, input=words(turn), previous_response_id=previous, max_output_tokens=8, **fields
        )
        response = raw.parse()
        sent.append((response, raw.headers.get("statestore-context")))
        previous = response.id
    return sent


def _prompts(sent: list[tuple[Response, str | None]]) -> list[int]:
    return [response.usage.input_tokens if response.usage else 0 for response, _ in sent]


@pytest.mark.parametrize("window", [NARROW, "auto", 100_000])
def test_truncation_auto_keeps_a_chain_inside_the_servers_window(
    window: int | str, narrow_stack: Stack, narrow_gpt: openai.OpenAI
) -> None:
    """With the window the server has, with `auto` (read from the server's /props), and with one set far too large
    (the server refuses, statestore cuts and sends once more): every turn succeeds inside the real window."""
    narrow_stack.set_policy(context_strategy="truncate", context_window_tokens=window)
    sent = _long_chain(narrow_gpt, 36, truncation="auto")
    prompts = _prompts(sent)
    moved = [turn for turn, (_, header) in enumerate(sent) if header is not None]
    assert moved, prompts
    assert {sent[turn][1] for turn in moved} == {"truncated"}
    assert max(prompts) < NARROW
    for turn in moved:
        assert prompts[turn] <= 0.5 * NARROW + 200, (turn, prompts)
    if window != 100_000:
        assert max(prompts) <= 0.8 * NARROW + 200  # moved at the trigger, never near the server's own limit


def test_without_truncation_the_servers_refusal_is_relayed(narrow_stack: Stack, narrow_gpt: openai.OpenAI) -> None:
    narrow_stack.set_policy(context_strategy="truncate", context_window_tokens=100_000)
    with pytest.raises(openai.BadRequestError) as refused:
        _long_chain(narrow_gpt, 36)  # truncation: "disabled", the default
    assert "exceeds the available context size" in refused.value.message
    body: Any = refused.value.body
    assert body["type"] == "exceed_context_size_error"
