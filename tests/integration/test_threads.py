"""Message threads through the official SDK against a real statestore process (docs/protocol.md §2): create, continue,
per-turn fields, streaming, fork, owners, the async client.

Every test checks what the backend received: the full rebuilt request, without `thread` and without the threads beta.
The helpers here are shared by the other `test_threads_*.py` modules.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anthropic
import httpx
import orjson
import pytest
from anthropic.types.beta import BetaMessage, BetaMessageParam, BetaToolParam

from statestore.threads.ids import thread_of_response
from tests.support.fake_backend import FakeBackend, message_action
from tests.support.server import StatestoreServer

THREADS_BETA = "message-threads-2026-08-12"
MODEL = "claude-test"
SYSTEM = "You answer in one short sentence."
WEATHER_TOOL: BetaToolParam = {
    "name": "get_weather",
    "description": "The weather of a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}

# -- building the expected conversation ---------------------------------------------------------------------------


def user(text: str) -> BetaMessageParam:
    return {"role": "user", "content": text}


def echo(text: str) -> list[dict[str, Any]]:
    """The content of the fake backend's default reply to a user turn `text`."""
    return [{"type": "text", "text": f"echo: {text}"}]


def said(content: Sequence[Mapping[str, Any]] | BetaMessage | Mapping[str, Any]) -> dict[str, Any]:
    """The assistant message a reply becomes in the history: its content exactly as the backend sent it."""
    if isinstance(content, BetaMessage):
        blocks = content.to_dict()["content"]
    elif isinstance(content, Mapping):
        blocks = content["content"]
    else:
        blocks = list(content)
    return {"role": "assistant", "content": blocks}


# -- what the backend received -------------------------------------------------------------------------------------


def forwarded(backend: FakeBackend, index: int = -1, *, rebuilt: bool = True) -> dict[str, Any]:
    """The body of a `/v1/messages` request the backend received, checked to be a plain Messages request: no `thread`
    field, no threads beta, no statestore header, and (for a threaded turn, `rebuilt`) the rebuilt layout: the turn's
    fields, then `system`, `tools`, `messages` last."""
    request = backend.requests()[index]
    assert request.path == "/v1/messages"
    body: dict[str, Any] = request.json()
    assert "thread" not in body
    assert THREADS_BETA not in (request.header("anthropic-beta") or "")
    assert not [name for name, _ in request.headers if name.startswith("statestore-")]
    if not rebuilt:
        return body
    keys = list(body)
    tail = [key for key in ("system", "tools", "messages") if key in body]
    assert keys[-len(tail) :] == tail, f"system, tools and messages must come last, in that order: {keys}"
    return body


def only(body: Mapping[str, Any], *drop: str) -> dict[str, Any]:
    """`body` without the given keys, for comparing the rest of a request."""
    return {key: value for key, value in body.items() if key not in drop}


def minted(message_id: str, *, not_: str | None = None) -> str:
    """Check `message_id` is one statestore minted (and not the backend's id `not_`); return its thread id."""
    assert message_id.startswith("msg_")
    assert message_id != not_
    thread_id = thread_of_response(message_id)
    assert thread_id is not None, f"{message_id} is not a statestore response id"
    return thread_id


def expires_in(response_headers: Mapping[str, str]) -> float:
    """Seconds from now to the response's `statestore-expires-at`."""
    return (timestamp(response_headers["statestore-expires-at"]) - datetime.now(UTC)).total_seconds()


def timestamp(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def clock_offset(offset_file: Path) -> float:
    """How far (seconds) the clock of the `clock_server` fixture is ahead of the wall clock."""
    text = offset_file.read_text().strip() if offset_file.exists() else ""
    return float(text) if text else 0.0


def advance_clock(offset_file: Path, seconds: float) -> None:
    """Move the clock of the `clock_server` fixture forward (never back: other tests share that server)."""
    scratch = offset_file.with_suffix(".new")
    scratch.write_text(str(clock_offset(offset_file) + seconds))
    os.replace(scratch, offset_file)  # the server reads the file on every clock call: never let it see half of it


# -- the raw HTTP API ------------------------------------------------------------------------------------------------


class RawThreads:
    """Plain HTTP requests to statestore's `/v1/messages` for one owner, for what the SDK helper hides."""

    def __init__(self, base_url: str, api_key: str) -> None:
        self.http = httpx.Client(
            base_url=base_url,
            headers={"x-api-key": api_key, "anthropic-version": "2023-06-01", "content-type": "application/json"},
            timeout=20,
        )

    def post(
        self, body: Mapping[str, Any], *, headers: Mapping[str, str] | None = None, beta: bool = True
    ) -> httpx.Response:
        all_headers = {"anthropic-beta": THREADS_BETA} if beta else {}
        return self.http.post("/v1/messages", content=orjson.dumps(body), headers={**all_headers, **(headers or {})})

    def create(
        self, messages: Sequence[Mapping[str, Any]], *, headers: Mapping[str, str] | None = None, **fields: Any
    ) -> httpx.Response:
        body = {"model": MODEL, "max_tokens": 256, **fields, "messages": list(messages), "thread": {"type": "create"}}
        return self.post(body, headers=headers)

    def continue_(
        self,
        previous_id: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        headers: Mapping[str, str] | None = None,
        **fields: Any,
    ) -> httpx.Response:
        body = {
            "model": MODEL,
            "max_tokens": 256,
            **fields,
            "messages": list(messages),
            "thread": {"type": "continue", "previous_message_id": previous_id},
        }
        return self.post(body, headers=headers)

    def assert_stored_expiry(self, response: httpx.Response) -> None:
        """The thread's stored expiry (thread API, milliseconds) is the one the response granted (seconds)."""
        stored = timestamp(self.info(response.headers["statestore-thread-id"])["expires_at"])
        granted = timestamp(response.headers["statestore-expires-at"])
        assert 0 <= (stored - granted).total_seconds() < 1, (stored, granted)

    def info(self, thread_id: str) -> dict[str, Any]:
        """The thread's metadata from statestore's thread API (docs/protocol.md §7)."""
        response = self.http.get(f"/statestore/v1/threads/{thread_id}")
        assert response.status_code == 200, response.text
        info: dict[str, Any] = response.json()
        return info

    def close(self) -> None:
        self.http.close()


def ok(response: httpx.Response) -> dict[str, Any]:
    """The Message of a 200 threaded reply, with its thread headers checked."""
    assert response.status_code == 200, response.text
    assert response.headers["statestore-thread-id"].startswith("thr_")
    assert "statestore-expires-at" in response.headers
    message: dict[str, Any] = response.json()
    assert minted(message["id"]) == response.headers["statestore-thread-id"]
    return message


def thread_error(response: httpx.Response, status: int, error_code: str) -> dict[str, Any]:
    """The `error` object of a thread rejection, checked against docs/protocol.md §4."""
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error"
    assert body["request_id"] == response.headers["request-id"]
    assert response.headers["x-should-retry"] == "false"
    error: dict[str, Any] = body["error"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert error["details"]["error_code"] == error_code
    return error


def sse_events(response: httpx.Response) -> list[dict[str, Any]]:
    """The data of each event of an SSE body."""
    events = []
    for block in response.text.split("\n\n"):
        data = [line[len("data: ") :] for line in block.splitlines() if line.startswith("data: ")]
        if data:
            events.append(orjson.loads("\n".join(data)))
    return events


def forged_response_id() -> str:
    """A well-formed response id of a thread that does not exist."""
    alphabet = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
    return "msg_" + "".join(secrets.choice(alphabet) for _ in range(44))


@pytest.fixture
def raw(pg_server: StatestoreServer, api_key: str) -> Iterator[RawThreads]:
    threads = RawThreads(pg_server.url, api_key)
    yield threads
    threads.close()


# == 1. create ========================================================================================================


def test_create_with_the_thread_helper(server_client: anthropic.Anthropic, backend: FakeBackend) -> None:
    backend.script(message_action(echo("hello"), id="msg_from_backend_1"))
    thread = server_client.beta.messages.thread(model=MODEL, max_tokens=256, system=SYSTEM, tools=[WEATHER_TOOL])
    assert thread.previous_message_id is None

    reply = thread.send(user("hello"))

    minted(reply.id, not_="msg_from_backend_1")
    assert thread.previous_message_id == reply.id
    assert reply.to_dict()["content"] == echo("hello")
    [request] = backend.requests()
    body = forwarded(backend)
    assert body == {
        "max_tokens": 256,
        "model": MODEL,
        "system": SYSTEM,
        "tools": [WEATHER_TOOL],
        "messages": [user("hello")],
    }
    # The client's own credential reaches the backend (passthrough mode).
    assert request.header("authorization") == f"Bearer {server_client.api_key}"


def test_create_with_plain_create_returns_thread_headers(
    server_client: anthropic.Anthropic, backend: FakeBackend
) -> None:
    backend.script(message_action(echo("hi"), id="msg_from_backend_2"))
    raw_response = server_client.beta.messages.with_raw_response.create(
        model=MODEL,
        max_tokens=100,
        system=[{"type": "text", "text": SYSTEM}],
        messages=[user("hi")],
        thread={"type": "create"},
        betas=[THREADS_BETA, "other-beta-2025-01-01"],
    )
    reply = raw_response.parse()

    thread_id = minted(reply.id, not_="msg_from_backend_2")
    assert raw_response.headers["statestore-thread-id"] == thread_id
    assert 290 <= expires_in(raw_response.headers) <= 301  # the default policy: 300 seconds
    assert "statestore-session-id" not in raw_response.headers
    [request] = backend.requests()
    assert request.header("anthropic-beta") == "other-beta-2025-01-01"
    assert forwarded(backend) == {
        "max_tokens": 100,
        "model": MODEL,
        "system": [{"type": "text", "text": SYSTEM}],
        "messages": [user("hi")],
    }


# == 2. continue ======================================================================================================


def test_continue_rebuilds_the_whole_conversation(server_client: anthropic.Anthropic, backend: FakeBackend) -> None:
    thread = server_client.beta.messages.thread(
        model=MODEL, max_tokens=256, system=SYSTEM, tools=[WEATHER_TOOL], metadata={"user_id": "u-1"}
    )
    history: list[Any] = []
    ids: list[str] = []
    for text in ("first", "second", "third", "fourth"):
        reply = thread.send(user(text))
        history.append(user(text))
        body = forwarded(backend)
        assert body == {
            "max_tokens": 256,
            "model": MODEL,
            "metadata": {"user_id": "u-1"},
            "system": SYSTEM,
            "tools": [WEATHER_TOOL],
            "messages": history,
        }
        assert reply.to_dict()["content"] == echo(text)
        history.append(said(reply))
        ids.append(reply.id)
    # One thread, a new response id per turn, and one backend request per turn.
    assert len({minted(i) for i in ids}) == 1
    assert len(set(ids)) == 4
    assert len(backend.requests()) == 4


def test_continue_rebuilds_rich_replies_exactly(raw: RawThreads, backend: FakeBackend) -> None:
    """Stored replies are kept exactly as the backend returned them: thinking with its signature, tool_use input."""
    rich: list[dict[str, Any]] = [
        {"type": "thinking", "thinking": "Weather needs a tool.", "signature": "c2lnbmF0dXJlLWJ5dGVz=="},
        {"type": "text", "text": "Let me check.", "citations": None},
        {"type": "tool_use", "id": "toolu_01XyZ", "name": "get_weather", "input": {"city": "Paris", "n": [1, 2.5]}},
    ]
    backend.script(message_action(rich, stop_reason="tool_use"))
    first = ok(
        raw.create([user("weather?")], tools=[WEATHER_TOOL], thinking={"type": "enabled", "budget_tokens": 1024})
    )
    assert first["content"] == rich
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01XyZ", "content": "sunny"}]}
    second = ok(raw.continue_(first["id"], [result], thinking={"type": "enabled", "budget_tokens": 1024}))
    body = forwarded(backend)
    assert body["messages"] == [user("weather?"), said(rich), result]
    assert body["thinking"] == {"type": "enabled", "budget_tokens": 1024}
    assert body["tools"] == [WEATHER_TOOL]
    # The stored reply went out as the backend's own bytes, key order included.
    assert orjson.dumps(said(rich)) in backend.requests()[-1].body
    assert second["content"][-1]["text"] == "echo: (1 tool result)"


# == 3. per-turn fields ===============================================================================================


def test_per_turn_overrides_apply_to_that_turn_only(server_client: anthropic.Anthropic, backend: FakeBackend) -> None:
    thread = server_client.beta.messages.thread(
        model=MODEL, max_tokens=256, system=SYSTEM, metadata={"user_id": "thread-user"}
    )
    first = thread.send(user("one"))
    base = {"max_tokens": 256, "model": MODEL, "metadata": {"user_id": "thread-user"}}
    assert only(forwarded(backend), "system", "messages") == base

    # `temperature` is not among the SDK 2.14.0 thread's send() fields (ThreadSendParams): it goes as extra_body.
    second = thread.send(
        user("two STOP here"),
        max_tokens=50,
        metadata={"user_id": "turn-user"},
        stop_sequences=["STOP"],
        extra_body={"temperature": 0.25},
    )
    body = forwarded(backend)
    assert only(body, "system", "messages") == {
        "max_tokens": 50,
        "model": MODEL,
        "metadata": {"user_id": "turn-user"},
        "stop_sequences": ["STOP"],
        "temperature": 0.25,
    }
    assert body["system"] == SYSTEM
    assert body["messages"] == [user("one"), said(first), user("two STOP here")]
    assert second.stop_reason == "stop_sequence"
    assert second.to_dict()["content"] == [{"type": "text", "text": "echo: two "}]

    third = thread.send(user("three"))
    body = forwarded(backend)
    assert only(body, "system", "messages") == base
    assert body["messages"] == [user("one"), said(first), user("two STOP here"), said(second), user("three")]
    assert third.stop_reason == "end_turn"


def test_raw_continue_fields_are_the_turns_own(raw: RawThreads, backend: FakeBackend) -> None:
    """A continue sends every field but `system`/`tools`; the rebuilt request takes this turn's fields, in the client's
    order, and nothing of the earlier turns' fields."""
    first = ok(raw.create([user("a")], system=SYSTEM, temperature=1.0, top_k=5, cache_control={"type": "ephemeral"}))
    second = ok(raw.continue_(first["id"], [user("b")], model="claude-other", max_tokens=64, top_p=0.5))
    body = forwarded(backend)
    assert list(body) == ["model", "max_tokens", "top_p", "system", "messages"]
    assert body == {
        "model": "claude-other",
        "max_tokens": 64,
        "top_p": 0.5,
        "system": SYSTEM,
        "messages": [user("a"), said(first), user("b")],
    }
    assert second["model"] == "claude-other"


# == 4. streaming =====================================================================================================


def test_stream_continue_then_send(server_client: anthropic.Anthropic, backend: FakeBackend) -> None:
    thread = server_client.beta.messages.thread(model=MODEL, max_tokens=256, system=SYSTEM)
    first = thread.send(user("one"))

    with thread.stream(user("two")) as stream:
        text = "".join(stream.text_stream)
        streamed = stream.get_final_message()
    assert text == "echo: two"
    assert streamed.id == thread.previous_message_id
    minted(streamed.id)
    assert minted(streamed.id) == minted(first.id)
    streamed_request = forwarded(backend)
    assert streamed_request["stream"] is True
    assert streamed_request["messages"] == [user("one"), said(first), user("two")]

    third = thread.send(user("three"))
    body = forwarded(backend)
    assert "stream" not in body
    assert body["messages"] == [user("one"), said(first), user("two"), said(echo("two")), user("three")]
    assert third.id == thread.previous_message_id
    assert minted(third.id) == minted(first.id)


def test_stream_create_stores_a_rich_reply(server_client: anthropic.Anthropic, backend: FakeBackend) -> None:
    """A streamed reply is captured from the SSE events and stored as the backend built it."""
    rich: list[dict[str, Any]] = [
        {"type": "thinking", "thinking": "Think it over, then call.", "signature": "EqQBCkYIBxgCKkB="},
        {"type": "text", "text": "Checking the weather now."},
        {"type": "tool_use", "id": "toolu_01Stream", "name": "get_weather", "input": {"city": "Oslo", "days": [1, 2]}},
    ]
    backend.script(message_action(rich, stop_reason="tool_use"))
    thread = server_client.beta.messages.thread(model=MODEL, max_tokens=256, tools=[WEATHER_TOOL])
    with thread.stream(user("weather in Oslo?")) as stream:
        reply = stream.get_final_message()
    assert reply.id == thread.previous_message_id
    result: BetaMessageParam = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_01Stream", "content": "cold"}],
    }
    thread.send(result)
    assert forwarded(backend)["messages"] == [user("weather in Oslo?"), said(rich), result]


# == 17. fork =========================================================================================================


def test_fork_creates_with_the_full_history_and_both_continue(
    server_client: anthropic.Anthropic, backend: FakeBackend
) -> None:
    thread = server_client.beta.messages.thread(model=MODEL, max_tokens=256, system=SYSTEM, tools=[WEATHER_TOOL])
    a1 = thread.send(user("one"))
    a2 = thread.send(user("two"))
    shared = [user("one"), said(a1), user("two"), said(a2)]

    fork = thread.fork()
    assert fork.previous_message_id is None
    f3 = fork.send(user("fork three"))
    body = forwarded(backend)
    assert body == {
        "max_tokens": 256,
        "model": MODEL,
        "system": SYSTEM,
        "tools": [WEATHER_TOOL],
        "messages": [*shared, user("fork three")],
    }
    assert minted(f3.id) != minted(a2.id)

    t3 = thread.send(user("main three"))
    assert forwarded(backend)["messages"] == [*shared, user("main three")]
    assert minted(t3.id) == minted(a2.id)

    fork.send(user("fork four"))
    assert forwarded(backend)["messages"] == [*shared, user("fork three"), said(f3), user("fork four")]
    thread.send(user("main four"))
    assert forwarded(backend)["messages"] == [*shared, user("main three"), said(t3), user("main four")]


# == 18. owners =======================================================================================================


def test_another_owner_cannot_continue_a_thread(
    client: anthropic.Anthropic, pg_server: StatestoreServer, raw: RawThreads, backend: FakeBackend
) -> None:
    thread = client.beta.messages.thread(model=MODEL, max_tokens=256, system=SYSTEM)
    first = thread.send(user("mine"))
    requests_before = len(backend.requests())

    stranger = RawThreads(pg_server.url, f"sk-test-{secrets.token_hex(8)}")
    try:
        thread_error(stranger.continue_(first.id, [user("theirs")]), 404, "thread_not_found")
        # Nor by repeating the thread's own system prompt, nor with the SDK helper (which replays into its own thread).
        thread_error(stranger.continue_(first.id, [user("theirs")], system=SYSTEM), 404, "thread_not_found")
    finally:
        stranger.close()
    assert len(backend.requests()) == requests_before

    second = thread.send(user("still mine"))
    assert forwarded(backend)["messages"] == [user("mine"), said(first), user("still mine")]
    assert minted(second.id) == minted(first.id)
    # For its owner the first id is merely stale, not unknown.
    thread_error(raw.continue_(first.id, [user("again")]), 400, "thread_already_continued")


# == 20. the async client =============================================================================================


async def test_async_client_send_and_stream(server: StatestoreServer, api_key: str, backend: FakeBackend) -> None:
    async with anthropic.AsyncAnthropic(base_url=server.url, api_key=api_key, max_retries=0) as client:
        thread = client.beta.messages.thread(model=MODEL, max_tokens=256, system=SYSTEM)
        first = await thread.send(user("async one"))
        assert thread.previous_message_id == first.id
        minted(first.id)

        async with thread.stream(user("async two")) as stream:
            pieces = [text async for text in stream.text_stream]
            streamed = await stream.get_final_message()
        assert "".join(pieces) == "echo: async two"
        assert streamed.id == thread.previous_message_id
        assert forwarded(backend)["stream"] is True

        third = await thread.send(user("async three"))
        body = forwarded(backend)
        assert body["system"] == SYSTEM
        assert body["messages"] == [
            user("async one"),
            said(first),
            user("async two"),
            said(streamed),
            user("async three"),
        ]
        assert minted(third.id) == minted(first.id)
