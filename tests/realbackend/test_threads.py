"""The Messages door against llama.cpp's server: threads through the SDK's helper and its stream, sessions, tool use,
the stateless relay beside the same request sent straight to the server, and the usage totals a thread keeps beside
what the server reported for each turn. The model's words are gibberish; its wire, tokenizer and counts are real."""

from __future__ import annotations

from typing import Any, cast

import anthropic
import httpx
import orjson
from anthropic.types.beta import BetaMessageParam, BetaToolParam

from tests.realbackend.conftest import Stack
from tests.realbackend.llama import MODEL_NAME
from tests.support.admin_api import THREADS_BETA

# Sampling is greedy by llama-server's own default here (--temp 0): this SDK's calls take no sampling fields.
WEATHER: BetaToolParam = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"],
    },
}


def user(text: str) -> BetaMessageParam:
    return {"role": "user", "content": text}


def info(stack: Stack, api_key: str, thread_id: str) -> dict[str, Any]:
    response = httpx.get(
        f"{stack.statestore.url}/statestore/v1/threads/{thread_id}", headers={"x-api-key": api_key}, timeout=30
    )
    assert response.status_code == 200, response.text
    value: dict[str, Any] = response.json()
    return value


def test_a_thread_helper_conversation_keeps_the_servers_usage(
    claude: anthropic.Anthropic, stack: Stack, api_key: str
) -> None:
    thread = claude.beta.messages.thread(model=MODEL_NAME, max_tokens=12, system="Answer briefly.")
    replies = [thread.send(user(text)) for text in ("Hello there.", "What is a thread?", "And a session?")]
    with thread.stream(user("Say it once more, streamed.")) as stream:
        for _ in stream.text_stream:
            pass
        streamed = stream.get_final_message()
    replies.append(streamed)

    assert all(reply.id.startswith("msg_") for reply in replies)
    # Each turn's prompt holds the whole conversation before it: llama-server counted it growing.
    prompts = [reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) for reply in replies]
    assert prompts == sorted(prompts) and len(set(prompts)) == len(prompts)
    # llama-server's prompt cache kept the rebuilt prefix: every continue read most of its prompt from it.
    assert all((reply.usage.cache_read_input_tokens or 0) > 0 for reply in replies[1:])
    thread_id = thread.previous_message_id
    assert thread_id is not None
    metadata = info(stack, api_key, info_id(thread_id))
    assert metadata["message_count"] == 8
    assert metadata["usage"]["output_tokens"] == sum(reply.usage.output_tokens for reply in replies)


def test_usage_totals_are_what_the_server_reported(claude: anthropic.Anthropic, stack: Stack, api_key: str) -> None:
    raw = claude.beta.messages.with_raw_response.create(
        model=MODEL_NAME, max_tokens=10, messages=[user("Count to three.")], thread={"type": "create"},
        betas=[THREADS_BETA],
    )  # fmt: skip
    thread_id = raw.headers["statestore-thread-id"]
    replies = [raw.parse()]
    for text in ("Again.", "Once more."):
        replies.append(
            claude.beta.messages.create(
                model=MODEL_NAME,
                max_tokens=10,
                messages=[user(text)],
                thread={"type": "continue", "previous_message_id": replies[-1].id},
                betas=[THREADS_BETA],
            )
        )
    usage = info(stack, api_key, thread_id)["usage"]
    assert usage["input_tokens"] == sum(reply.usage.input_tokens for reply in replies)
    assert usage["output_tokens"] == sum(reply.usage.output_tokens for reply in replies) == 30
    assert usage["cache_read_input_tokens"] == sum(reply.usage.cache_read_input_tokens or 0 for reply in replies)
    # llama.cpp reports no cache writes: the field is absent from its usage, and counts as nothing.
    assert usage["cache_creation_input_tokens"] == 0
    assert all(reply.usage.cache_creation_input_tokens is None for reply in replies)


def test_a_threaded_continue_sends_what_a_stateless_client_would(
    claude: anthropic.Anthropic, direct_claude: anthropic.Anthropic
) -> None:
    """The rebuilt request is the one a client holding the whole history sends: the server counts the same prompt and,
    sampling greedily, says the same words."""
    thread = claude.beta.messages.thread(model=MODEL_NAME, max_tokens=8, system="Be terse.")
    history: list[BetaMessageParam] = []
    for text in ("One.", "Two.", "Three."):
        reply = thread.send(user(text))
        history += [user(text), cast(BetaMessageParam, {"role": "assistant", "content": reply.to_dict()["content"]})]
    final = thread.send(user("Four."))
    direct = direct_claude.beta.messages.create(
        model=MODEL_NAME, max_tokens=8, system="Be terse.", messages=[*history, user("Four.")]
    )
    assert [block.to_dict() for block in final.content] == [block.to_dict() for block in direct.content]
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == direct.usage.input_tokens + (
        direct.usage.cache_read_input_tokens or 0
    )


def test_the_stateless_relay_returns_the_servers_bytes(stack: Stack, api_key: str) -> None:
    body = orjson.dumps(
        {"model": MODEL_NAME, "max_tokens": 16, "messages": [user("Relay me.")], "temperature": 0, "top_k": 1}
    )
    headers = {"x-api-key": api_key, "anthropic-version": "2023-06-01", "content-type": "application/json"}
    # One slot, one prompt cache: a first request fills it, so the two compared read the same share of it.
    httpx.post(f"{stack.llama.url}/v1/messages", content=body, headers=headers, timeout=60)
    through = httpx.post(f"{stack.statestore.url}/v1/messages", content=body, headers=headers, timeout=60)
    direct = httpx.post(f"{stack.llama.url}/v1/messages", content=body, headers=headers, timeout=60)
    assert through.status_code == direct.status_code == 200
    relayed, own = through.json(), direct.json()
    # The server mints a new id per request; everything else is the same bytes.
    assert through.content.replace(relayed["id"].encode(), own["id"].encode()) == direct.content
    assert relayed["id"].startswith("chatcmpl-")  # llama.cpp's ids, not Anthropic's msg_ ones, relayed as they are


def test_a_stateless_stream_is_relayed_event_for_event(stack: Stack, api_key: str) -> None:
    body = orjson.dumps(
        {"model": MODEL_NAME, "max_tokens": 6, "messages": [user("Stream me.")], "stream": True, "temperature": 0}
    )
    headers = {"x-api-key": api_key, "anthropic-version": "2023-06-01", "content-type": "application/json"}

    def events(url: str) -> list[tuple[str, dict[str, Any]]]:
        response = httpx.post(f"{url}/v1/messages", content=body, headers=headers, timeout=60)
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        found = []
        for frame in response.text.split("\n\n"):
            lines = dict(line.split(": ", 1) for line in frame.splitlines() if ": " in line)
            if "data" in lines:
                data = orjson.loads(lines["data"])
                if data.get("type") == "message_start":
                    data["message"].pop("id")
                found.append((lines.get("event", ""), data))
        return found

    events(stack.llama.url)  # fills the prompt cache, so the two compared read the same share of it
    assert events(stack.statestore.url) == events(stack.llama.url)


def test_a_session_continues_by_name(claude: anthropic.Anthropic) -> None:
    headers = {"statestore-session-id": "real-session-1"}
    first = claude.beta.messages.create(
        model=MODEL_NAME, max_tokens=8, messages=[user("Remember me.")], extra_headers=headers
    )
    raw = claude.beta.messages.with_raw_response.create(
        model=MODEL_NAME, max_tokens=8, messages=[user("Do you?")], extra_headers=headers
    )
    second = raw.parse()
    assert raw.headers["statestore-session-id"] == "real-session-1"
    # The second prompt holds the first turn, its reply and the new message.
    grown = second.usage.input_tokens + (second.usage.cache_read_input_tokens or 0)
    assert grown > first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0) + first.usage.output_tokens


def test_a_tool_call_and_its_result_go_round_on_a_thread(
    claude: anthropic.Anthropic, stack: Stack, api_key: str
) -> None:
    """Random weights never call a tool of their own accord (and llama.cpp does not force one for this template's
    tool_choice), so the thread starts from a history that holds a call and its result; the server renders both with
    the tools through its chat template, and the continue after them carries all of it."""
    call: BetaMessageParam = {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "toolu_real_1", "name": "get_weather", "input": {"city": "Paris"}}],
    }
    result: BetaMessageParam = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_real_1", "content": "Sunny, 21 C."}],
    }
    thread = claude.beta.messages.thread(model=MODEL_NAME, max_tokens=8, tools=[WEATHER])
    reply = thread.send(user("Weather in Paris?"), call, result)
    answer = thread.send(user("And in Oslo?"))
    assert answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0) > reply.usage.input_tokens + (
        reply.usage.cache_read_input_tokens or 0
    )
    exported = httpx.get(
        f"{stack.statestore.url}/statestore/v1/threads/{info_id(answer.id)}/messages",
        headers={"x-api-key": api_key},
        timeout=30,
    ).json()
    assert [message["role"] for message in exported["messages"]] == [
        "user", "assistant", "user", "assistant", "user", "assistant"
    ]  # fmt: skip
    assert exported["messages"][1] == call and exported["messages"][2] == result
    assert exported["tools"] == [WEATHER]


def info_id(response_id: str) -> str:
    from statestore.threads.ids import thread_of_response

    thread = thread_of_response(response_id)
    assert thread is not None
    return thread


def test_a_stream_the_server_opens_without_message_start_is_given_one_and_stored(
    claude: anthropic.Anthropic, stack: Stack, api_key: str
) -> None:
    """llama.cpp's server sends `message_start` with its first token's text, and none at all when that token is part
    of a UTF-8 character (as this prompt's is): the stream then opens with `content_block_start`, which the SDK's
    accumulator refuses. A threaded turn gets the `message_start` it lacked, so the reply is read and stored."""
    text = ("a long shared history the quick brown fox jumps over the lazy dog " * 10)[:500]
    body = {"model": MODEL_NAME, "max_tokens": 8, "stream": True, "messages": [user(text)]}
    direct = httpx.post(f"{stack.llama.url}/v1/messages", json=body, timeout=60)
    assert direct.text.startswith("event: content_block_start"), direct.text[:200]

    thread = claude.beta.messages.thread(model=MODEL_NAME, max_tokens=8)
    with thread.stream(user(text)) as stream:
        streamed = stream.get_final_message()
    assert streamed.id.startswith("msg_") and streamed.content
    after = thread.send(user("And after it?"))
    exported = httpx.get(
        f"{stack.statestore.url}/statestore/v1/threads/{info_id(after.id)}/messages",
        headers={"x-api-key": api_key},
        timeout=30,
    ).json()
    assert [message["role"] for message in exported["messages"]] == ["user", "assistant", "user", "assistant"]
    assert exported["messages"][1]["content"] == [block.to_dict() for block in streamed.content]
