"""The pieces of a background response's events that need no live service: the storage replay's sequence, the
in-process event log's rules (one run per stream, no number twice), and the run's coalescing publisher."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from statestore.content_keys import Scope
from statestore.responses.background_events import Publisher, final_frame, with_status
from statestore.responses.replay import replayed_frames, run_frames
from statestore.store.event_log import Event, MemoryEventLog, Superseded


def _parsed(frames: list[bytes]) -> list[dict[str, Any]]:
    return [orjson.loads(frame.split(b"\ndata: ", 1)[1]) for frame in frames]


STORED = orjson.dumps(
    {
        "id": "resp_1",
        "object": "response",
        "status": "completed",
        "output": [
            {
                "type": "message",
                "id": "msg_1",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "hello", "annotations": [], "logprobs": []}],
            },
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "c1",
                "name": "f",
                "arguments": "{}",
                "status": "completed",
            },
        ],
        "usage": {"input_tokens": 1},
    }
)


def test_a_stored_response_replays_as_a_streamed_create_would_have_sent_it() -> None:
    events = _parsed(replayed_frames(STORED, after=-1))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert events[-1]["response"] == orjson.loads(STORED)
    # resumed after a number: only what follows it
    assert _parsed(replayed_frames(STORED, after=10))[0]["sequence_number"] == 11


def test_a_run_asked_for_as_json_tells_its_events_after_the_queued_ones() -> None:
    events = _parsed(run_frames(STORED, first=2))
    assert [e["sequence_number"] for e in events] == list(range(2, 2 + len(events)))
    assert events[0]["type"] == "response.in_progress" and events[-1]["type"] == "response.completed"
    assert [e["type"] for e in events[1:]] == [e["type"] for e in _parsed(replayed_frames(STORED, after=1))]


def test_a_background_response_replays_as_its_run_numbered_it() -> None:
    background = orjson.dumps({**orjson.loads(STORED), "background": True})
    events = _parsed(replayed_frames(background, after=-1))
    assert [e["type"] for e in events[:3]] == ["response.created", "response.queued", "response.in_progress"]
    assert events[0]["response"]["status"] == "queued" and events[0]["response"]["output"] == []
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert _parsed(replayed_frames(background, after=1)) == _parsed(run_frames(background, first=2))


def test_the_final_event_is_named_by_the_status() -> None:
    for status, kind in (("failed", "response.failed"), ("cancelled", "response.cancelled")):
        body = with_status(STORED, status, {"code": "server_error", "message": "m"} if status == "failed" else None)
        event = _parsed([final_frame(body, 7)])[0]
        assert event["type"] == kind and event["sequence_number"] == 7
        assert event["response"]["status"] == status


async def test_one_run_owns_a_stream_and_no_number_is_written_twice() -> None:
    log = MemoryEventLog(cap=100)
    await log.publish("r", 0, [Event(0, b"a"), Event(1, b"b")], ttl_ms=1000)
    await log.publish("r", 1, [Event(2, b"c")], ttl_ms=1000)
    await log.publish("r", 1, [Event(2, b"c")], ttl_ms=1000)  # sent again (its answer lost): taken as written
    with pytest.raises(Superseded):
        await log.publish("r", 1, [Event(2, b"again"), Event(3, b"on")], ttl_ms=1000)
    await log.publish("r", 2, [Event(3, b"d", final=True)], ttl_ms=1000)
    with pytest.raises(Superseded):
        await log.publish("r", 1, [Event(4, b"late")], ttl_ms=1000)  # an older run, after a newer one wrote
    assert [e.frame for e in await log.read("r", 0, block_ms=0)] == [b"b", b"c", b"d"]
    assert await log.last("r") == (3, 2)


async def test_a_follower_wakes_when_events_arrive() -> None:
    log = MemoryEventLog(cap=100)
    await log.publish("r", 0, [Event(0, b"a")], ttl_ms=1000)
    waiting = asyncio.ensure_future(log.read("r", 0, block_ms=5000))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    await log.publish("r", 1, [Event(1, b"b")], ttl_ms=1000)
    assert [e.seq for e in await asyncio.wait_for(waiting, 1)] == [1]
    assert await log.read("r", 1, block_ms=10) == []


async def test_the_publisher_coalesces_and_reports_a_later_run() -> None:
    calls: list[list[int]] = []

    class Counting(MemoryEventLog):
        async def publish(
            self, response_id: str, attempt: int, events: Any, ttl_ms: int, *, scope: Scope | None = None
        ) -> None:
            calls.append([e.seq for e in events])
            await asyncio.sleep(0.01)
            await super().publish(response_id, attempt, events, ttl_ms, scope=scope)

    log = Counting(cap=100)
    publisher = Publisher(log, "r", 1, 1000)
    publisher.add(Event(2, b"x"))
    await asyncio.sleep(0)  # its publish is under way
    for seq in range(3, 8):
        publisher.add(Event(seq, b"x"))
    await publisher.drain()
    assert calls == [[2], [3, 4, 5, 6, 7]]  # what came meanwhile gathers behind the publish in flight
    await log.publish("r", 2, [Event(8, b"newer run")], ttl_ms=1000)
    publisher.add(Event(8, b"y"))
    with pytest.raises(Superseded):
        await publisher.drain()
    with pytest.raises(Superseded):
        publisher.add(Event(9, b"z"))
