"""Thread errors and how the SDK recovers from them, against a real statestore process (docs/protocol.md §2, §4, §5):
unknown and expired ids, stale ids, concurrent continues, backend errors and retries, broken streams, refusals and
fallback-served replies. Each checks that what is stored is exactly the turns that completed."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import anthropic
import httpx
import orjson
import pytest

from tests.integration.test_threads import (
    MODEL,
    SYSTEM,
    THREADS_BETA,
    RawThreads,
    advance_clock,
    echo,
    forged_response_id,
    forwarded,
    minted,
    ok,
    said,
    sse_events,
    thread_error,
    user,
)
from tests.support.fake_backend import FakeBackend, error_action, message_action
from tests.support.server import StatestoreServer


@pytest.fixture
def raw(pg_server: StatestoreServer, api_key: str) -> Iterator[RawThreads]:
    threads = RawThreads(pg_server.url, api_key)
    yield threads
    threads.close()


# == 5. unknown and expired ids =======================================================================================


@pytest.mark.parametrize(
    "previous_id",
    [
        pytest.param(forged_response_id(), id="well-formed"),
        pytest.param("msg_01XFDUDYJgAACzvnptvVoYEL", id="backend-shaped"),
        pytest.param("not-an-id", id="garbage"),
    ],
)
def test_unknown_id_is_thread_not_found(raw: RawThreads, backend: FakeBackend, previous_id: str) -> None:
    response = raw.continue_(previous_id, [user("hello?")])
    error = thread_error(response, 404, "thread_not_found")
    assert error["message"]
    assert backend.requests() == []


def test_expired_thread_is_not_found_and_the_sdk_replays(
    clock_server: StatestoreServer, clock_offset_file: Path, api_key: str, backend: FakeBackend
) -> None:
    raw = RawThreads(clock_server.url, api_key)
    with anthropic.Anthropic(base_url=clock_server.url, api_key=api_key, max_retries=0) as client:
        thread = client.beta.messages.thread(model=MODEL, max_tokens=256, system=SYSTEM)
        first = thread.send(user("one"))
        lost_thread = minted(first.id)
        advance_clock(clock_offset_file, 61)  # the policy's default TTL here is 60 seconds

        thread_error(raw.continue_(first.id, [user("raw two")]), 404, "thread_not_found")
        assert raw.http.get(f"/statestore/v1/threads/{lost_thread}").status_code == 404
        assert len(backend.requests()) == 1

        second = thread.send(user("two"))
        requests = backend.requests()
        assert len(requests) == 2  # the 404 never reached the backend; the replay did
        assert forwarded(backend) == {
            "max_tokens": 256,
            "model": MODEL,
            "system": SYSTEM,
            "messages": [user("one"), said(first), user("two")],
        }
        assert thread.previous_message_id == second.id
        assert minted(second.id) != lost_thread

        thread.send(user("three"))  # the new thread goes on as usual
        assert forwarded(backend)["messages"] == [user("one"), said(first), user("two"), said(second), user("three")]
    raw.close()


# == 6. stale ids =====================================================================================================


def test_stale_id_is_already_continued(raw: RawThreads, backend: FakeBackend) -> None:
    first = ok(raw.create([user("one")], system=SYSTEM))
    second = ok(raw.continue_(first["id"], [user("two")]))

    error = thread_error(raw.continue_(first["id"], [user("two again")]), 400, "thread_already_continued")
    assert error["message"]
    # A streamed turn is refused the same way, before any stream starts: a JSON error, never an SSE `error` event.
    streamed = raw.continue_(first["id"], [user("two again")], stream=True)
    thread_error(streamed, 400, "thread_already_continued")
    assert streamed.headers["content-type"].startswith("application/json")
    assert len(backend.requests()) == 2

    ok(raw.continue_(second["id"], [user("three")]))
    assert forwarded(backend)["messages"] == [user("one"), said(first), user("two"), said(second), user("three")]


def test_sdk_replays_after_its_id_went_stale(
    client: anthropic.Anthropic, raw: RawThreads, backend: FakeBackend
) -> None:
    thread = client.beta.messages.thread(model=MODEL, max_tokens=256, system=SYSTEM)
    first = thread.send(user("one"))
    assert first.id == thread.previous_message_id
    # Someone else (same owner) continues the same id first.
    elsewhere = ok(raw.continue_(first.id, [user("elsewhere")]))
    assert minted(elsewhere["id"]) == minted(first.id)

    second = thread.send(user("two"))
    assert forwarded(backend) == {
        "max_tokens": 256,
        "model": MODEL,
        "system": SYSTEM,
        "messages": [user("one"), said(first), user("two")],
    }
    assert minted(second.id) != minted(first.id)
    assert thread.previous_message_id == second.id
    # Both lines of the conversation live on.
    ok(raw.continue_(elsewhere["id"], [user("elsewhere two")]))
    elsewhere_line = [user("one"), said(first), user("elsewhere"), said(elsewhere), user("elsewhere two")]
    assert forwarded(backend)["messages"] == elsewhere_line


# == 7. concurrent continues ==========================================================================================


def test_concurrent_continues_one_wins(raw: RawThreads, backend: FakeBackend) -> None:
    first = ok(raw.create([user("one")]))
    backend.script({"kind": "echo", "delay_seconds": 0.5})
    barrier = threading.Barrier(2)
    results: dict[str, httpx.Response] = {}

    def attempt(text: str) -> None:
        barrier.wait()
        results[text] = raw.continue_(first["id"], [user(text)])

    workers = [threading.Thread(target=attempt, args=(text,)) for text in ("left", "right")]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()

    statuses = sorted(response.status_code for response in results.values())
    assert statuses == [200, 400], {text: response.text for text, response in results.items()}
    [winner] = [text for text, response in results.items() if response.status_code == 200]
    [loser] = [text for text, response in results.items() if response.status_code == 400]
    thread_error(results[loser], 400, "thread_continue_in_flight")
    assert len(backend.requests()) == 2  # the create, and the winner only

    # Exactly one new turn: the winner's id continues from the winner's turn, the first id is stale.
    won = results[winner].json()
    info = raw.info(minted(first["id"]))
    assert (info["turn_count"], info["message_count"], info["head_message_id"]) == (2, 4, won["id"])
    thread_error(raw.continue_(first["id"], [user(loser)]), 400, "thread_already_continued")
    ok(raw.continue_(won["id"], [user("after")]))
    assert forwarded(backend)["messages"] == [user("one"), said(first), user(winner), said(won), user("after")]


# == 8. backend errors and the SDK's retry ============================================================================


def test_backend_529_then_sdk_retry_keeps_the_conversation(
    pg_server: StatestoreServer, api_key: str, raw: RawThreads, backend: FakeBackend
) -> None:
    with anthropic.Anthropic(base_url=pg_server.url, api_key=api_key, max_retries=2) as client:
        thread = client.beta.messages.thread(model=MODEL, max_tokens=256, system=SYSTEM)
        first = thread.send(user("one"))
        backend.script(error_action(529, "overloaded_error", "Overloaded", headers={"retry-after-ms": "10"}))

        second = thread.send(user("two"))

        requests = backend.requests()
        assert len(requests) == 3
        # The retry is the same rebuilt request, byte for byte (docs/protocol.md §2).
        assert requests[2].body == requests[1].body
        assert forwarded(backend) == {
            "max_tokens": 256,
            "model": MODEL,
            "system": SYSTEM,
            "messages": [user("one"), said(first), user("two")],
        }
        assert minted(second.id) == minted(first.id)
        info = raw.info(minted(first.id))
        assert (info["turn_count"], info["message_count"], info["head_message_id"]) == (2, 4, second.id)

        thread.send(user("three"))
        assert forwarded(backend)["messages"] == [user("one"), said(first), user("two"), said(second), user("three")]


def test_backend_error_is_relayed_and_stores_nothing(raw: RawThreads, backend: FakeBackend) -> None:
    first = ok(raw.create([user("one")]))
    backend.script(error_action(529, "overloaded_error", "Overloaded", headers={"request-id": "req_backend_529"}))
    failed = raw.continue_(first["id"], [user("two")])
    assert failed.status_code == 529
    assert failed.headers["request-id"] == "req_backend_529"
    assert failed.json()["error"] == {"type": "overloaded_error", "message": "Overloaded"}
    assert "statestore-thread-id" not in failed.headers

    ok(raw.continue_(first["id"], [user("two, again")]))
    assert forwarded(backend)["messages"] == [user("one"), said(first), user("two, again")]


# == 9. a stream the client leaves ====================================================================================


def test_client_leaving_a_stream_stores_nothing(
    client: anthropic.Anthropic, raw: RawThreads, backend: FakeBackend
) -> None:
    thread = client.beta.messages.thread(model=MODEL, max_tokens=256, system=SYSTEM)
    first = thread.send(user("one"))
    long_text = [{"type": "text", "text": "a reply long enough to come in several deltas, " * 4}]
    # message_start, ping, content_block_start, a first text delta; then the backend stalls with the stream open.
    backend.script(message_action(long_text, stall_after_events=4, stall_seconds=1.0))

    with thread.stream(user("two")) as stream:
        for event in stream:
            if event.type == "text":
                break
    assert backend.pending() == 0
    # The SDK, which never saw message_stop, replays its next turn in a new thread; the raw API shows what is stored.
    assert thread.previous_message_id is None

    # statestore notices the client went away and gives the head back; the old id continues.
    response = _continue_when_free(raw, first.id, [user("two, again")])
    assert ok(response)["content"] == echo("two, again")
    assert raw.info(minted(first.id))["message_count"] == 4
    assert forwarded(backend)["messages"] == [user("one"), said(first), user("two, again")]
    # Had the broken turn been stored late, its lease would be gone and this id stale; the conversation goes on.
    response = raw.continue_(response.json()["id"], [user("three")])
    assert ok(response)["content"] == echo("three")
    assert forwarded(backend)["messages"] == [
        user("one"),
        said(first),
        user("two, again"),
        said(echo("two, again")),
        user("three"),
    ]


def test_backend_cutting_a_stream_stores_nothing(raw: RawThreads, backend: FakeBackend) -> None:
    first = ok(raw.create([user("one")]))
    backend.script(message_action(echo("partial"), cut_after_events=4))
    with pytest.raises(httpx.HTTPError):
        raw.continue_(first["id"], [user("two")], stream=True)
    response = _continue_when_free(raw, first["id"], [user("two, again")])
    ok(response)
    assert forwarded(backend)["messages"] == [user("one"), said(first), user("two, again")]


def test_a_commit_refused_at_the_end_relays_the_reply_up_to_message_stop(raw: RawThreads, backend: FakeBackend) -> None:
    first = ok(raw.create([user("one")]))
    # The backend stalls after its first text delta, then sends the rest (the last deltas, content_block_stop,
    # message_delta, message_stop) back to back; the thread is deleted meanwhile, so the commit at the end is refused.
    long_text = [{"type": "text", "text": "a reply long enough to come in several deltas, " * 4}]
    backend.script(message_action(long_text, stall_after_events=4, stall_seconds=1.0))
    body = {
        "model": MODEL,
        "max_tokens": 256,
        "stream": True,
        "messages": [user("two")],
        "thread": {"type": "continue", "previous_message_id": first["id"]},
    }
    received = b""
    with raw.http.stream(
        "POST", "/v1/messages", content=orjson.dumps(body), headers={"anthropic-beta": THREADS_BETA}
    ) as response:
        assert response.status_code == 200
        chunks = response.iter_raw()
        received += next(chunks)  # the stream has begun: the turn holds the head
        assert raw.http.delete(f"/statestore/v1/threads/{minted(first['id'])}").status_code == 200
        with pytest.raises(httpx.HTTPError):
            for chunk in chunks:
                received += chunk
    data = [line[len(b"data: ") :] for line in received.split(b"\n") if line.startswith(b"data: ")]
    events = [orjson.loads(item)["type"] for item in data]
    assert "message_stop" not in events  # not stored: its end is withheld and the stream cut
    # Everything before the end reached the client, so it holds the whole reply it was shown, as a partial one.
    assert events[-2:] == ["content_block_stop", "message_delta"], events


def test_stream_error_event_stores_nothing(raw: RawThreads, backend: FakeBackend) -> None:
    first = ok(raw.create([user("one")]))
    overloaded = {"type": "overloaded_error", "message": "Overloaded"}
    backend.script(message_action(echo("two"), error_after_events=4, error=overloaded))
    response = raw.continue_(first["id"], [user("two")], stream=True)
    assert response.status_code == 200
    events = sse_events(response)
    assert events[-1]["type"] == "error"
    assert events[-1]["error"] == overloaded
    assert {"type": "message_stop"} not in events
    ok(raw.continue_(first["id"], [user("two, again")]))
    assert forwarded(backend)["messages"] == [user("one"), said(first), user("two, again")]


def _continue_when_free(
    raw: RawThreads, previous_id: str, messages: Sequence[Mapping[str, Any]], *, within: float = 3.0
) -> httpx.Response:
    """Continue from `previous_id`, waiting out the moment statestore takes to notice a request that went away."""
    deadline = time.monotonic() + within
    while True:
        response = raw.continue_(previous_id, messages)
        busy = response.status_code == 400 and "thread_continue_in_flight" in response.text
        if not busy or time.monotonic() > deadline:
            return response
        time.sleep(0.05)


# == 10 is in test_threads_rules.py; 11. refusals =====================================================================


@pytest.mark.parametrize("stream", [False, True])
def test_refusal_is_returned_not_stored(raw: RawThreads, backend: FakeBackend, stream: bool) -> None:
    first = ok(raw.create([user("one")]))
    refusal = [{"type": "text", "text": "I can't help with that."}]
    backend.script(message_action(refusal, stop_reason="refusal"))
    response = raw.continue_(first["id"], [user("something bad")], stream=stream)
    assert response.status_code == 200
    if stream:
        events = sse_events(response)
        refused_id = events[0]["message"]["id"]
        assert events[-1] == {"type": "message_stop"}
    else:
        refused = response.json()
        assert refused["stop_reason"] == "refusal"
        assert refused["content"] == refusal
        refused_id = refused["id"]
    minted(refused_id)

    thread_error(raw.continue_(refused_id, [user("and now?")]), 404, "thread_not_found")
    # The head did not move: the turn before the refusal continues.
    ok(raw.continue_(first["id"], [user("something else")]))
    assert forwarded(backend)["messages"] == [user("one"), said(first), user("something else")]


def test_sdk_starts_a_new_thread_after_a_refusal(client: anthropic.Anthropic, backend: FakeBackend) -> None:
    thread = client.beta.messages.thread(model=MODEL, max_tokens=256, system=SYSTEM)
    first = thread.send(user("one"))
    backend.script(message_action([{"type": "text", "text": "No."}], stop_reason="refusal"))
    refused = thread.send(user("something bad"))
    assert refused.stop_reason == "refusal"
    assert thread.previous_message_id is None

    third = thread.send(user("something else"))
    # A create with the history the SDK kept (the refused turn left out), in a new thread.
    assert forwarded(backend) == {
        "max_tokens": 256,
        "model": MODEL,
        "system": SYSTEM,
        "messages": [user("one"), said(first), user("something else")],
    }
    assert minted(third.id) != minted(first.id)
    thread.send(user("four"))
    assert forwarded(backend)["messages"] == [
        user("one"),
        said(first),
        user("something else"),
        said(third),
        user("four"),
    ]


# == 12. fallback-served replies ======================================================================================


def _fallback_usage() -> dict[str, Any]:
    """`usage` of a reply a fallback model served: `usage.iterations` ends with a `fallback_message` entry
    (anthropic.types.beta.BetaFallbackMessageIterationUsage)."""
    iteration = {"cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "input_tokens": 12}
    return {
        "input_tokens": 24,
        "output_tokens": 10,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "iterations": [
            {"type": "message", "model": MODEL, "output_tokens": 0, **iteration},
            {"type": "fallback_message", "model": "claude-fallback", "output_tokens": 10, **iteration},
        ],
    }


@pytest.mark.parametrize("stream", [False, True])
def test_fallback_served_reply_is_returned_not_stored(raw: RawThreads, backend: FakeBackend, stream: bool) -> None:
    backend.script(message_action(echo("one"), usage=_fallback_usage(), model="claude-fallback"))
    response = raw.create([user("one")], stream=stream)
    assert response.status_code == 200
    if stream:
        events = sse_events(response)
        served_id = events[0]["message"]["id"]
        delta = next(e for e in events if e["type"] == "message_delta")
        assert delta["usage"]["iterations"][-1]["type"] == "fallback_message"
    else:
        served = response.json()
        assert served["usage"] == _fallback_usage()  # the backend's usage, unchanged
        served_id = served["id"]
    minted(served_id)

    thread_error(raw.continue_(served_id, [user("two")]), 404, "thread_not_found")
    assert len(backend.requests()) == 1


def test_sdk_starts_a_new_thread_after_a_fallback_reply(client: anthropic.Anthropic, backend: FakeBackend) -> None:
    thread = client.beta.messages.thread(model=MODEL, max_tokens=256, system=SYSTEM)
    first = thread.send(user("one"))
    backend.script(message_action(echo("two"), usage=_fallback_usage(), model="claude-fallback"))
    served = thread.send(user("two"))
    assert served.usage.iterations is not None
    assert served.usage.iterations[-1].type == "fallback_message"
    assert thread.previous_message_id is None

    thread.send(user("three"))
    # The fallback reply stays in the SDK's history and is replayed in a create.
    assert forwarded(backend) == {
        "max_tokens": 256,
        "model": MODEL,
        "system": SYSTEM,
        "messages": [user("one"), said(first), user("two"), said(served), user("three")],
    }
