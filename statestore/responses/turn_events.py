"""A Responses turn told as its stream of events, from the backend's chunks to the commit: what a streamed
`POST /v1/responses` sends its client, and what a background turn publishes for any client to resume.

`response.completed` (or `.incomplete`) is framed after the commit, so a client that saw it can continue from the
response; a turn that cannot be completed raises StreamBrokenOff, having stored nothing."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import orjson

from statestore.errors import ServiceUnavailable, StatestoreError, StreamBrokenOff
from statestore.responses.prepared import PreparedResponse
from statestore.responses.stream import ChunkTranslator, SequencedEvents
from statestore.responses.turns import ResponseTurns
from statestore.store.engine import DATABASE_ERRORS
from statestore.upstream.client import StreamInterrupted, UpstreamResponse
from statestore.upstream.sse import SSEParser

FINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed", "response.cancelled"})


async def turn_events(
    turns: ResponseTurns,
    prepared: PreparedResponse,
    upstream: UpstreamResponse,
    numbered: SequencedEvents,
    *,
    announce: bool = True,
    before_commit: Callable[[], Awaitable[None]] | None = None,
) -> AsyncGenerator[bytes]:
    """The turn's SSE frames, numbered by `numbered`. `announce`: open with `response.created` (a background turn's
    was sent when it was queued); `response.in_progress` always comes first of what the run itself sends.
    `before_commit`: awaited just before the commit, which it stops by raising."""
    skeleton = turns.response(prepared, status="in_progress", output=[], usage=None)
    if announce:
        yield numbered.frame({"type": "response.created", "response": skeleton})
    yield numbered.frame({"type": "response.in_progress", "response": skeleton})
    for compacting in _compaction_events(prepared.compaction) if prepared.compaction is not None else ():
        yield numbered.frame(compacting)
    parser, translator = SSEParser(), ChunkTranslator(first_index=1 if prepared.compaction is not None else 0)
    try:
        async for chunk in upstream.chunks():
            for event in parser.feed(chunk):
                for translated in translator.feed(event.data):
                    yield numbered.frame(translated)
    except StreamInterrupted as exc:
        raise StreamBrokenOff(f"the backend stream broke off ({exc}); nothing stored") from exc
    except StatestoreError as exc:
        raise StreamBrokenOff(f"the backend stream was malformed ({exc.message}); nothing stored") from exc
    if not translator.complete:
        raise StreamBrokenOff("the backend stream ended before its reply did; nothing stored")
    closing, output, status, incomplete, usage = translator.finish()
    for closing_event in closing:
        yield numbered.frame(closing_event)
    output = with_compaction(prepared, output)
    response = turns.response(prepared, status=status, output=output, usage=usage, incomplete=incomplete)
    body = orjson.dumps(response)
    if before_commit is not None:
        await before_commit()  # a background run: still this replica's, and not cancelled (raises otherwise)
    prepared.committing = True  # from here on a cancel lets the turn complete (responses/background_runs.py)
    try:
        committed = await turns.commit(prepared, response, body)
    except ServiceUnavailable as exc:  # a commit whose answer was lost, settled as not stored (or not known)
        raise StreamBrokenOff(f"{exc.message}; completion withheld") from exc
    except DATABASE_ERRORS as exc:
        raise StreamBrokenOff(f"the turn was not committed ({type(exc).__name__}); completion withheld") from exc
    if not committed:
        raise StreamBrokenOff(
            "nothing was stored (the conversation's lease was lost, or the previous response was deleted); "
            "completion withheld"
        )
    final = "response.completed" if status == "completed" else "response.incomplete"
    yield numbered.frame_response(final, body)


def with_compaction(prepared: PreparedResponse, output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The turn's output: the compaction item first when the turn compacted its context (docs/responses.md)."""
    return [prepared.compaction, *output] if prepared.compaction is not None else output


def _compaction_events(item: dict[str, Any]) -> list[dict[str, Any]]:
    """The compaction item as output item 0. The summary was made before the stream began (so that a failing backend
    is still an HTTP error, as for any turn): its events come at once, in the order the SDK's accumulator expects."""
    return [
        {"type": "response.output_item.added", "output_index": 0, "item": item},
        {"type": "response.compaction.compacting", "item_id": item["id"], "output_index": 0},
        {"type": "response.output_item.done", "output_index": 0, "item": item},
    ]
