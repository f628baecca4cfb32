"""What a background turn publishes, and how: its events coalesced into few writes to the event log, and the final
event of a Response however the turn ended."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import orjson

from statestore.content_keys import Scope
from statestore.responses.replay import final_event_type
from statestore.responses.response_object import complete
from statestore.responses.stream import SequencedEvents
from statestore.store.event_log import Event, EventLog, EventLogUnavailable, Superseded

log = logging.getLogger(__name__)


def decode_headers(raw: bytes | None) -> list[tuple[bytes, bytes]]:
    return [(name.encode("latin-1"), value.encode("latin-1")) for name, value in orjson.loads(raw or b"[]")]


def with_status(body: bytes, status: str, error: dict[str, str] | None = None) -> bytes:
    """A background response's Response as queued, now with this status (and error): a turn that ended unfinished
    has no completed_at, output or usage."""
    response = complete(orjson.loads(body))
    response["status"] = status
    if error is not None:
        response["error"] = error
    return orjson.dumps(response)


def final_frame(body: bytes, seq: int) -> bytes:
    numbered = SequencedEvents()
    numbered.next = seq
    status = orjson.loads(body).get("status", "failed")
    return numbered.frame_response(final_event_type(str(status)), body)


class Publisher:
    """A run's events to the event log, coalesced: while one publish is in flight the next events gather, and go in
    the following one, so a fast stream costs a few round trips, not one per event."""

    def __init__(
        self,
        events: EventLog,
        response_id: str,
        attempt: int,
        ttl_ms: int,
        on_published: Callable[[], None] | None = None,
        *,
        scope: Scope | None = None,
    ) -> None:
        """`on_published`: called after each batch is kept (a follower on this replica wakes on it). `scope`: the
        turn's, which a sealed event log seals its events under."""
        self._scope = scope
        self._on_published = on_published
        self._events = events
        self._id = response_id
        self._attempt = attempt
        self._ttl_ms = ttl_ms
        self._pending: list[Event] = []
        self._flushing: asyncio.Task[None] | None = None
        self.superseded = False
        self._warned = False

    def add(self, event: Event) -> None:
        if self.superseded:
            raise Superseded("a later run owns this response's events")
        self._pending.append(event)
        if self._flushing is None:
            self._flushing = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        try:
            while self._pending and not self.superseded:
                batch, self._pending = self._pending, []
                try:
                    await self._events.publish(self._id, self._attempt, batch, self._ttl_ms, scope=self._scope)
                    if self._on_published is not None:
                        self._on_published()
                except Superseded:
                    self.superseded = True
                except EventLogUnavailable as exc:
                    if not self._warned:
                        self._warned = True
                        log.warning(
                            "background events not kept; a resumed stream replays from storage",
                            extra={"response_id": self._id, "error": str(exc)},
                        )
        finally:
            self._flushing = None

    async def drain(self) -> None:
        while self._flushing is not None:
            await asyncio.shield(self._flushing)
        if self.superseded:
            raise Superseded("a later run owns this response's events")
