"""Background events sealed at rest (encryption at rest): an event carries the reply's content as it streams, so each
frame is sealed under its turn's scope before it reaches the event log (a Redis Stream, or the process's memory) and
opened when it is read back for a replay or a follower.

Only the frame is sealed: the stream id (the sequence number), the attempt and the final flag stay clear, so the
publish script's checks (a later attempt, numbers taken) work on sealed events as on clear ones. A frame is bound to
its response and its sequence number: moved to another stream or another place in one, it does not open."""

from __future__ import annotations

from collections.abc import Sequence

from statestore.content_keys import ContentKeys, Scope, row_data
from statestore.store.event_log import Event, EventLog


def event_data(response_id: str, seq: int) -> bytes:
    return row_data("ev", response_id, seq)


class SealedEventLog:
    """An EventLog whose frames are sealed; the log underneath keeps them as bytes like any other."""

    def __init__(self, inner: EventLog, content: ContentKeys) -> None:
        self._inner = inner
        self._keys = content

    async def publish(
        self, response_id: str, attempt: int, events: Sequence[Event], ttl_ms: int, *, scope: Scope | None = None
    ) -> None:
        if not events:
            return
        if scope is None:
            raise ValueError("a sealed event log publishes under the turn's scope")
        sealer = await self._keys.sealer(scope)
        sealed = [
            Event(event.seq, sealer.seal(event.frame, event_data(response_id, event.seq)), event.final)
            for event in events
        ]
        await self._inner.publish(response_id, attempt, sealed, ttl_ms, scope=scope)

    async def read(self, response_id: str, after: int, *, block_ms: int) -> list[Event]:
        found = await self._inner.read(response_id, after, block_ms=block_ms)
        if not found:
            return found
        data = [event_data(response_id, event.seq) for event in found]
        frames = await self._keys.open_many([e.frame for e in found], data, row=f"events:{response_id}")
        return [Event(event.seq, frame, event.final) for event, frame in zip(found, frames, strict=True)]

    async def last(self, response_id: str) -> tuple[int, int] | None:
        return await self._inner.last(response_id)

    async def aclose(self) -> None:
        await self._inner.aclose()


def sealed_event_log(inner: EventLog, content: ContentKeys) -> EventLog:
    """`inner` itself with encryption off (no cost), else its frames sealed."""
    return SealedEventLog(inner, content) if content.enabled else inner
