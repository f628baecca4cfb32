"""A finished response told again as events, from what is stored: what a resumed stream sends when the events a
background turn published are gone (Redis flushed, or expired). The sequence is the one a streamed `POST
/v1/responses` of the same Response would have sent: created, in progress, each output item opened, filled and
closed, then the final event with the Response as stored."""

from __future__ import annotations

from typing import Any

import orjson

from statestore.responses.response_object import unfinished
from statestore.responses.stream import SequencedEvents

_FINAL = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed"}


def final_event_type(status: str) -> str:
    return _FINAL.get(status, "response.cancelled")


def _item_events(index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
    item_id = item.get("id")
    if item.get("type") == "message":
        opened = {**item, "status": "in_progress", "content": []}
        events: list[dict[str, Any]] = [{"type": "response.output_item.added", "output_index": index, "item": opened}]
        for part_index, part in enumerate(item.get("content") or []):
            where = {"item_id": item_id, "output_index": index, "content_index": part_index}
            text = part.get("text", "") if isinstance(part, dict) else ""
            empty = {**part, "text": ""} if isinstance(part, dict) else part
            events += [
                {"type": "response.content_part.added", **where, "part": empty},
                {"type": "response.output_text.delta", **where, "delta": text, "logprobs": []},
                {"type": "response.output_text.done", **where, "text": text, "logprobs": []},
                {"type": "response.content_part.done", **where, "part": part},
            ]
    elif item.get("type") == "function_call":
        opened = {**item, "status": "in_progress", "arguments": ""}
        arguments = item.get("arguments", "")
        where = {"item_id": item_id, "output_index": index}
        events = [
            {"type": "response.output_item.added", "output_index": index, "item": opened},
            {"type": "response.function_call_arguments.delta", **where, "delta": arguments},
            {
                "type": "response.function_call_arguments.done",
                **where,
                "name": item.get("name"),
                "arguments": arguments,
            },
        ]
    else:
        events = [{"type": "response.output_item.added", "output_index": index, "item": item}]
    events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    return events


def _frames(body: bytes, *, first: int, created: bool) -> list[bytes]:
    response = orjson.loads(body)
    skeleton = unfinished(response, "in_progress")
    events: list[dict[str, Any]] = [{"type": "response.created", "response": skeleton}] if created else []
    events.append({"type": "response.in_progress", "response": skeleton})
    for index, item in enumerate(response.get("output") or []):
        if isinstance(item, dict):
            events += _item_events(index, item)
    numbered = SequencedEvents()
    numbered.next = first
    frames = [numbered.frame(event) for event in events]
    frames.append(numbered.frame_response(final_event_type(str(response.get("status"))), body))
    return frames


def queued_frames(queued: bytes) -> list[bytes]:
    """A background response's first two events, around the Response as queued: `response.created`, `.queued`."""
    numbered = SequencedEvents()
    return [numbered.frame_response("response.created", queued), numbered.frame_response("response.queued", queued)]


def replayed_frames(body: bytes, *, after: int) -> list[bytes]:
    """The SSE frames of a stored Response's events numbered above `after`: for a background one, as its run numbered
    them (created and queued, then the run's own from 2), else as a streamed create would have."""
    response = orjson.loads(body)
    if response.get("background"):
        queued = orjson.dumps(unfinished(response, "queued"))
        frames = [*queued_frames(queued), *_frames(body, first=2, created=False)]
    else:
        frames = _frames(body, first=0, created=True)
    return frames[after + 1 :] if after >= 0 else frames


def run_frames(body: bytes, *, first: int) -> list[bytes]:
    """A background run's own events, told from its stored Response (a run asked for as JSON): from
    `response.in_progress`, numbered from `first` (after the events that said it was queued)."""
    return _frames(body, first=first, created=False)
