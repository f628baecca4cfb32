"""The rules of a thread, against a real statestore process: pause_turn, threads turned off, cache_control markers,
fixed fields, tools added mid-thread with the tool runner, TTLs and sessions (docs/protocol.md §2, §3, §5, §6, §8)."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from anthropic import beta_tool
from anthropic.types.beta import BetaCacheControlEphemeralParam, BetaMessageParam, BetaToolParam
from pydantic import BaseModel

from tests.integration.test_threads import (
    MODEL,
    SYSTEM,
    THREADS_BETA,
    WEATHER_TOOL,
    RawThreads,
    advance_clock,
    clock_offset,
    echo,
    expires_in,
    forwarded,
    minted,
    ok,
    said,
    thread_error,
    timestamp,
    user,
)
from tests.support.fake_backend import FakeBackend, error_action, message_action
from tests.support.server import StatestoreServer

EPHEMERAL: BetaCacheControlEphemeralParam = {"type": "ephemeral"}


@pytest.fixture
def raw(pg_server: StatestoreServer, api_key: str) -> Iterator[RawThreads]:
    threads = RawThreads(pg_server.url, api_key)
    yield threads
    threads.close()


# == 10. pause_turn ===================================================================================================


def test_pause_turn_resumes_from_an_empty_turn(client: anthropic.Anthropic, backend: FakeBackend) -> None:
    paused_content: list[dict[str, Any]] = [
        {"type": "server_tool_use", "id": "srvtoolu_01Pause", "name": "web_search", "input": {"query": "news"}},
        {"type": "text", "text": "Still searching"},
    ]
    backend.script(message_action(paused_content, stop_reason="pause_turn"))
    thread = client.beta.messages.thread(model=MODEL, max_tokens=256, system=SYSTEM)
    paused = thread.send(user("what is new?"))
    assert paused.stop_reason == "pause_turn"
    assert thread.previous_message_id == paused.id

    resumed = thread.send()  # nothing staged: the SDK continues with `messages: []`
    body = forwarded(backend)
    assert body == {
        "max_tokens": 256,
        "model": MODEL,
        "system": SYSTEM,
        "messages": [user("what is new?"), said(paused_content)],
    }
    assert resumed.to_dict()["content"] == echo("(continuing)")
    assert minted(resumed.id) == minted(paused.id)

    thread.send(user("thanks"))
    assert forwarded(backend)["messages"] == [
        user("what is new?"),
        said(paused_content),
        said(resumed),
        user("thanks"),
    ]


# == 13. threads turned off ===========================================================================================


def test_threads_off_is_unsupported_and_the_sdk_can_go_unthreaded(
    threads_off_server: StatestoreServer, api_key: str, backend: FakeBackend
) -> None:
    with anthropic.Anthropic(base_url=threads_off_server.url, api_key=api_key, max_retries=0) as client:
        strict = client.beta.messages.thread(model=MODEL, max_tokens=256, system=SYSTEM)
        with pytest.raises(anthropic.BadRequestError) as raised:
            strict.send(user("one"))
        error = raised.value
        assert error.status_code == 400
        assert error.response.headers["x-should-retry"] == "false"
        assert isinstance(error.body, dict)
        assert error.body["error"]["type"] == "invalid_request_error"
        assert error.body["error"]["details"]["error_code"] == "thread_unsupported_request"
        assert isinstance(error.body["error"]["details"]["unsupported"], list)
        # A session is a threaded turn too.
        raw = RawThreads(threads_off_server.url, api_key)
        session = raw.post(
            {"model": MODEL, "max_tokens": 256, "messages": [user("one")]},
            headers={"statestore-session-id": "off-session"},
            beta=False,
        )
        raw.close()
        thread_error(session, 400, "thread_unsupported_request")
        assert backend.requests() == []

        lenient = client.beta.messages.thread(
            model=MODEL, max_tokens=256, system=SYSTEM, unsupported_request_behavior="continue_unthreaded"
        )
        first = lenient.send(user("one"))
        assert lenient.previous_message_id is None
        [request] = backend.requests()
        assert request.header("anthropic-beta") is None
        expected = {"max_tokens": 256, "messages": [user("one")], "model": MODEL, "system": SYSTEM}
        assert forwarded(backend, rebuilt=False) == expected

        lenient.send(user("two"))
        assert len(backend.requests()) == 2  # no more thread attempts: every turn is a plain relay
        assert forwarded(backend, rebuilt=False) == {
            "max_tokens": 256,
            "model": MODEL,
            "system": SYSTEM,
            "messages": [user("one"), said(first), user("two")],
        }


# == 14. cache_control markers ========================================================================================


def _marked(text: str) -> BetaMessageParam:
    return {"role": "user", "content": [{"type": "text", "text": text, "cache_control": EPHEMERAL}]}


def _unmarked(text: str) -> BetaMessageParam:
    return {"role": "user", "content": [{"type": "text", "text": text}]}


def test_cache_markers_three_at_most_and_earlier_turns_lose_theirs(raw: RawThreads, backend: FakeBackend) -> None:
    system = [{"type": "text", "text": SYSTEM, "cache_control": EPHEMERAL}]
    tools: list[BetaToolParam] = [{**WEATHER_TOOL, "cache_control": EPHEMERAL}]

    four = [_marked("a"), {"role": "assistant", "content": "b"}, _marked("c")]
    error = thread_error(raw.create(four, system=system, tools=tools), 400, "thread_unsupported_request")
    assert error["details"]["unsupported"] == ["cache_control"]
    assert backend.requests() == []

    first = ok(raw.create([_marked("one")], system=system, tools=tools))  # system + tools + one message: 3
    assert forwarded(backend)["messages"] == [_marked("one")]

    second = ok(raw.continue_(first["id"], [_marked("two")]))  # the stored marker of "one" is not counted
    body = forwarded(backend)
    assert body["system"] == system
    assert body["tools"] == tools
    assert body["messages"] == [_unmarked("one"), said(first), _marked("two")]

    # A marker nested in a tool result counts too: 2 stored (system, tools) + 2 new.
    nested: BetaMessageParam = {
        "role": "user",
        "content": [
            {
                "type": "tool_result",
                "tool_use_id": "toolu_x",
                "content": [{"type": "text", "text": "r", "cache_control": EPHEMERAL}],
            },
            {"type": "text", "text": "three", "cache_control": EPHEMERAL},
        ],
    }
    error = thread_error(raw.continue_(second["id"], [nested]), 400, "thread_unsupported_request")
    assert error["details"]["unsupported"] == ["cache_control"]
    assert len(backend.requests()) == 2

    # The rejected turn gave the head back; a top-level (automatic) cache_control is a turn field, not a marker.
    ok(raw.continue_(second["id"], [_marked("three")], cache_control=EPHEMERAL))
    body = forwarded(backend)
    assert body["cache_control"] == EPHEMERAL
    assert body["messages"] == [_unmarked("one"), said(first), _unmarked("two"), said(second), _marked("three")]


def test_sdk_marking_each_new_turn_keeps_working(client: anthropic.Anthropic, backend: FakeBackend) -> None:
    thread = client.beta.messages.thread(
        model=MODEL,
        max_tokens=256,
        system=[{"type": "text", "text": SYSTEM, "cache_control": EPHEMERAL}],
        tools=[{**WEATHER_TOOL, "cache_control": EPHEMERAL}],
    )
    replies = [thread.send(_marked(text)) for text in ("one", "two", "three")]
    body = forwarded(backend)
    assert body["messages"] == [
        _unmarked("one"),
        said(replies[0]),
        _unmarked("two"),
        said(replies[1]),
        _marked("three"),
    ]
    assert body["system"][0]["cache_control"] == EPHEMERAL
    assert body["tools"][0]["cache_control"] == EPHEMERAL
    assert len({minted(reply.id) for reply in replies}) == 1


# == 15. fixed fields =================================================================================================


def test_fixed_fields_must_match_the_create(raw: RawThreads, backend: FakeBackend) -> None:
    system = [{"type": "text", "text": SYSTEM}]
    output_config = {"effort": "low"}
    first = ok(raw.create([user("one")], system=system, tools=[WEATHER_TOOL], output_config=output_config))

    other_tool = {**WEATHER_TOOL, "description": "Another description."}
    for changed, fields in (
        ("system", {"system": "Something else.", "output_config": output_config}),
        ("tools", {"tools": [other_tool], "output_config": output_config}),
        ("output_config", {"output_config": {"effort": "high"}}),
        ("output_config", {}),  # absent differs from the create's too: it is sent on every turn
    ):
        error = thread_error(raw.continue_(first["id"], [user("two")], **fields), 400, "thread_fingerprint_mismatch")
        assert changed in error["message"]
        assert [name for name in ("system", "tools", "output_config") if name in error["message"]] == [changed]
    both = raw.continue_(first["id"], [user("two")], system="Other.", tools=[], output_config=output_config)
    error = thread_error(both, 400, "thread_fingerprint_mismatch")
    assert "system" in error["message"]
    assert "tools" in error["message"]
    assert len(backend.requests()) == 1

    # Identical values are accepted, compared as canonical JSON (key order does not matter).
    same_system = [{"text": SYSTEM, "type": "text"}]
    same_tools = [dict(reversed(list(WEATHER_TOOL.items())))]
    second = ok(
        raw.continue_(first["id"], [user("two")], system=same_system, tools=same_tools, output_config=output_config)
    )
    body = forwarded(backend)
    assert body["system"] == system
    assert body["tools"] == [WEATHER_TOOL]
    assert body["output_config"] == output_config
    assert body["messages"] == [user("one"), said(first), user("two")]
    assert list(body).count("system") == 1
    assert minted(second["id"]) == minted(first["id"])


# == 16. the tool runner ==============================================================================================


@beta_tool
def get_weather(city: str) -> str:
    """The weather of a city.

    Args:
        city: The city.
    """
    return f"sunny in {city}"


@beta_tool
def get_time(zone: str) -> str:
    """The time in a time zone.

    Args:
        zone: An IANA time zone.
    """
    return f"12:00 in {zone}"


def test_tool_runner_over_a_thread_with_a_tool_added_mid_thread(
    client: anthropic.Anthropic, backend: FakeBackend
) -> None:
    inline_tools_beta = "inline-tools-2026-09-15"
    runner = client.beta.messages.tool_runner(
        model=MODEL,
        max_tokens=256,
        system=SYSTEM,
        tools=[get_weather],
        messages=[user("please call get_weather")],
        betas=[inline_tools_beta],
    )
    time_call: dict[str, Any] = {"type": "tool_use", "id": "toolu_01Time", "name": "get_time", "input": {"zone": "UTC"}}
    replies = []
    for reply in runner:
        replies.append(reply)
        if len(replies) == 1:
            runner.add_tools(get_time)
            # The echo backend only calls the thread's own tools; the added one is called by a scripted reply.
            backend.script(message_action([time_call], stop_reason="tool_use"))
    assert [reply.stop_reason for reply in replies] == ["tool_use", "tool_use", "end_turn"]
    weather_call = said(replies[0])["content"][-1]
    assert weather_call["name"] == "get_weather"
    assert weather_call["input"] == {"city": "please call get_weather"}

    requests = backend.requests()
    assert len(requests) == 3
    assert all(request.header("anthropic-beta") == inline_tools_beta for request in requests)
    weather_result = {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": weather_call["id"], "content": "sunny in please call get_weather"}
        ],
    }
    addition = {
        "role": "system",
        "content": [{"type": "tool_addition", "tool": {"type": "tool_definition", "definition": get_time.to_dict()}}],
    }
    time_result = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_01Time", "content": "12:00 in UTC"}],
    }
    body = forwarded(backend)
    assert body["system"] == SYSTEM
    assert body["tools"] == [get_weather.to_dict()]  # the thread's tools never change
    assert body["messages"] == [
        user("please call get_weather"),
        said(replies[0]),
        weather_result,
        addition,
        said([time_call]),
        time_result,
    ]
    assert len({minted(reply.id) for reply in replies}) == 1  # one thread for the whole run
    assert replies[-1].to_dict()["content"] == echo("(1 tool result)")


# == 19. TTL ==========================================================================================================


def test_ttl_header_is_granted_kept_and_validated(raw: RawThreads, backend: FakeBackend) -> None:
    created = raw.create([user("one")], headers={"statestore-ttl": "120"})
    first = ok(created)
    assert 117 <= expires_in(created.headers) <= 121
    raw.assert_stored_expiry(created)
    # The thread keeps its TTL on later turns; a turn may ask for another.
    kept = raw.continue_(first["id"], [user("two")])
    assert 117 <= expires_in(kept.headers) <= 121
    changed = raw.continue_(ok(kept)["id"], [user("three")], headers={"statestore-ttl": "30"})
    assert 27 <= expires_in(changed.headers) <= 31
    raw.assert_stored_expiry(changed)

    for invalid in ("abc", "0", "-5", "1.5", ""):
        response = raw.continue_(ok(changed)["id"], [user("four")], headers={"statestore-ttl": invalid})
        assert response.status_code == 400, invalid
        assert response.json()["error"]["type"] == "invalid_request_error"
        assert "statestore-ttl" in response.json()["error"]["message"]
    assert len(backend.requests()) == 3
    ok(raw.continue_(ok(changed)["id"], [user("four")]))  # the rejected turns held nothing


def test_ttl_is_clamped_and_sliding(
    clock_server: StatestoreServer, clock_offset_file: Path, api_key: str, backend: FakeBackend
) -> None:
    raw = RawThreads(clock_server.url, api_key)
    try:
        clamped = raw.create([user("long")], headers={"statestore-ttl": "100000"})
        ok(clamped)
        # The policy's maximum here is 300 seconds (on this server's clock, ahead of the wall clock).
        assert 297 <= expires_in(clamped.headers) - clock_offset(clock_offset_file) <= 301
        raw.assert_stored_expiry(clamped)

        # The default TTL here is 60 seconds; each turn moves the expiry forward, so a thread used often lives on.
        created = raw.create([user("one")])
        message = ok(created)
        expiries = [timestamp(created.headers["statestore-expires-at"])]
        answered = [time.time()]
        messages: list[Any] = [user("one"), said(message)]
        for text in ("two", "three"):
            advance_clock(clock_offset_file, 40)
            response = raw.continue_(message["id"], [user(text)])
            answered.append(time.time())
            message = ok(response)
            raw.assert_stored_expiry(response)
            messages += [user(text), said(message)]
            expiries.append(timestamp(response.headers["statestore-expires-at"]))
        # 80 seconds after the create, past its first expiry: alive only because the expiry slid, 40 s each turn (plus
        # the real time between the turns, which a loaded machine stretches past half a second; the header has whole
        # seconds, hence the one second either way).
        slid = [(later - earlier).total_seconds() for earlier, later in itertools.pairwise(expiries)]
        waited = [later - earlier for earlier, later in itertools.pairwise(answered)]
        assert all(39 <= moved - real <= 41 for moved, real in zip(slid, waited, strict=True)), (slid, waited)
        fourth = ok(raw.continue_(message["id"], [user("four")]))
        assert forwarded(backend)["messages"] == [*messages, user("four")]
        assert raw.info(minted(fourth["id"]))["message_count"] == 8

        # And a thread left alone for its TTL is gone.
        advance_clock(clock_offset_file, 61)
        thread_error(raw.continue_(fourth["id"], [user("five")]), 404, "thread_not_found")
    finally:
        raw.close()


# == 21. sessions =====================================================================================================


def _session_post(raw: RawThreads, session: str, messages: Sequence[Mapping[str, Any]], **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 256, **extra, "messages": list(messages)}
    return raw.post(body, headers={"statestore-session-id": session}, beta=False)


def test_session_creates_then_continues(raw: RawThreads, backend: FakeBackend, api_key: str) -> None:
    session = f"chat:{api_key[-8:]}.v1_x-y"
    created = _session_post(raw, session, [user("one")], system=SYSTEM)
    first = ok(created)
    assert created.headers["statestore-session-id"] == session
    thread_id = created.headers["statestore-thread-id"]
    assert forwarded(backend) == {"model": MODEL, "max_tokens": 256, "system": SYSTEM, "messages": [user("one")]}
    assert backend.requests()[-1].header("statestore-session-id") is None

    continued = _session_post(raw, session, [user("two")])
    second = ok(continued)
    assert continued.headers["statestore-session-id"] == session
    assert continued.headers["statestore-thread-id"] == thread_id
    assert forwarded(backend) == {
        "model": MODEL,
        "max_tokens": 256,
        "system": SYSTEM,
        "messages": [user("one"), said(first), user("two")],
    }

    # The session's thread is an ordinary thread: its latest id continues it with a `thread` field too.
    third = ok(raw.continue_(second["id"], [user("three")]))
    ok(_session_post(raw, session, [user("four")]))
    assert forwarded(backend)["messages"] == [
        user("one"),
        said(first),
        user("two"),
        said(second),
        user("three"),
        said(third),
        user("four"),
    ]


def test_session_concurrent_requests_one_is_in_flight(raw: RawThreads, backend: FakeBackend) -> None:
    session = "concurrent-session"
    first = ok(_session_post(raw, session, [user("one")]))
    backend.script({"kind": "echo", "delay_seconds": 0.5})
    barrier = threading.Barrier(2)
    results: dict[str, httpx.Response] = {}

    def attempt(text: str) -> None:
        barrier.wait()
        results[text] = _session_post(raw, session, [user(text)])

    workers = [threading.Thread(target=attempt, args=(text,)) for text in ("left", "right")]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert sorted(response.status_code for response in results.values()) == [200, 400]
    [winner] = [text for text, response in results.items() if response.status_code == 200]
    [loser] = [text for text, response in results.items() if response.status_code == 400]
    thread_error(results[loser], 400, "thread_continue_in_flight")

    won = ok(results[winner])
    ok(_session_post(raw, session, [user("after")]))
    assert forwarded(backend)["messages"] == [user("one"), said(first), user(winner), said(won), user("after")]


def test_thread_field_wins_over_the_session_header(raw: RawThreads, backend: FakeBackend) -> None:
    session = "rebound-session"
    old = ok(_session_post(raw, session, [user("old")]))
    # A create with both that stores nothing leaves the name where it was...
    backend.script(error_action(529, "overloaded_error", "Overloaded"))
    assert raw.create([user("lost")], headers={"statestore-session-id": session}).status_code == 529
    ok(_session_post(raw, session, [user("old two")]))
    assert forwarded(backend)["messages"] == [user("old"), said(old), user("old two")]

    # ...and one that completes binds the name to its new thread, though the old one is live (docs/protocol.md §6).
    created = raw.create([user("new")], headers={"statestore-session-id": session})
    new = ok(created)
    assert created.headers["statestore-session-id"] == session
    assert minted(new["id"]) != minted(old["id"])
    ok(_session_post(raw, session, [user("new two")]))
    assert forwarded(backend)["messages"] == [user("new"), said(new), user("new two")]
    old_head = raw.info(minted(old["id"]))["head_message_id"]
    # A continue with both follows its previous_message_id, not the session.
    continued = raw.continue_(old_head, [user("old three")], headers={"statestore-session-id": session})
    assert continued.headers["statestore-thread-id"] == minted(old["id"])
    assert "statestore-session-id" not in continued.headers
    assert forwarded(backend)["messages"][-1] == user("old three")
    assert len(forwarded(backend)["messages"]) == 5


@pytest.mark.parametrize("session", ["has space", "x" * 129, "é", "semi;colon", "slash/es"])
def test_invalid_session_id_is_rejected(raw: RawThreads, backend: FakeBackend, session: str) -> None:
    response = raw.http.post(
        "/v1/messages",
        json={"model": MODEL, "max_tokens": 256, "messages": [user("one")]},
        headers=[(b"statestore-session-id", session.encode())],
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "statestore-session-id" in error["message"]
    assert backend.requests() == []


@pytest.mark.parametrize(
    ("thread", "beta"),
    [
        pytest.param({"type": "create"}, False, id="no-beta"),
        pytest.param({"type": "continue"}, True, id="continue-without-id"),
        pytest.param({"type": "continue", "previous_message_id": ""}, True, id="empty-id"),
        pytest.param({"type": "create", "previous_message_id": "msg_x"}, True, id="create-with-id"),
        pytest.param({"type": "fork"}, True, id="unknown-type"),
        pytest.param("create", True, id="not-an-object"),
    ],
)
def test_malformed_thread_field_is_a_plain_400(raw: RawThreads, backend: FakeBackend, thread: Any, beta: bool) -> None:
    """A `thread` of another shape, or without the threads beta, is a plain 400: no error_code (docs/protocol.md §2)."""
    body = {"model": MODEL, "max_tokens": 256, "messages": [user("one")], "thread": thread}
    response = raw.post(body, beta=beta)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "details" not in error
    assert "thread" in error["message"]
    if not beta:
        assert THREADS_BETA in error["message"]
    assert backend.requests() == []


class Answer(BaseModel):
    text: str


def test_output_format_is_the_same_on_every_turn(client: anthropic.Anthropic, backend: FakeBackend) -> None:
    """The SDK sends the output format as `output_config` on every turn; the fixed-field check accepts it."""
    backend.script(
        message_action([{"type": "text", "text": '{"text": "first"}'}]),
        message_action([{"type": "text", "text": '{"text": "second"}'}]),
    )
    thread = client.beta.messages.thread(model=MODEL, max_tokens=256, output_format=Answer)
    first = thread.parse(user("one"))
    created = forwarded(backend)
    assert created["output_config"]["format"]["type"] == "json_schema"
    second = thread.parse(user("two"))
    assert (first.parsed_output, second.parsed_output) == (Answer(text="first"), Answer(text="second"))
    body = forwarded(backend)
    assert body["output_config"] == created["output_config"]
    assert body["messages"] == [user("one"), said(first), user("two")]
    assert minted(second.id) == minted(first.id)
