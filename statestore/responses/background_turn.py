"""One background run, whichever replica claimed it: the turn prepared as a foreground one (or as it was admitted),
its events those of a foreground streamed turn (responses/turn_events.py) published to the event log instead of a
socket, and the ways it ends (stored, failed, cancelled, withdrawn before its commit). The replica's loop that claims,
renews and stops runs is responses/background_runs.py's."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from dataclasses import dataclass, field

import orjson

from statestore.auth import Authenticator
from statestore.clock import Clock
from statestore.core.leased_log import CONVERSATIONS
from statestore.errors import StatestoreError, StreamBrokenOff
from statestore.metrics import BackgroundOutcome, Metrics
from statestore.responses.backend import summarizer
from statestore.responses.background_events import Publisher, decode_headers, final_frame, with_status
from statestore.responses.compaction_step import compact
from statestore.responses.errors import BackendError, OpenAIError
from statestore.responses.prepared import PreparedResponse
from statestore.responses.refusal_retry import send_turn
from statestore.responses.replay import run_frames
from statestore.responses.reply import output_of
from statestore.responses.request import read_turn
from statestore.responses.response_object import completed
from statestore.responses.stream import SequencedEvents
from statestore.responses.turn_events import turn_events, with_compaction
from statestore.responses.turns import ResponseTurns
from statestore.store.background_store import BackgroundJob, BackgroundStore
from statestore.store.engine import DATABASE_ERRORS
from statestore.store.event_log import Event, EventLog, EventLogUnavailable, Superseded
from statestore.upstream.client import Upstream, UpstreamResponse

log = logging.getLogger(__name__)

# The events sent when a turn is queued (response.created, response.queued); a run's own start after them.
FIRST_RUN_EVENT = 2
_FINAL_FRAMES = (b"event: response.completed", b"event: response.incomplete")


class Withdrawn(Exception):
    """A run may not commit: its turn was cancelled, or another replica holds it now."""


@dataclass(slots=True, eq=False)
class Held:
    """A turn this replica holds a claim on."""

    job: BackgroundJob
    started: bool  # its row says in_progress (else queued, waiting for a worker here)
    prepared: PreparedResponse | None = None  # taken at admission (a conversation's lease with it)
    headers: list[tuple[bytes, bytes]] | None = None  # the admitting request's, as the row keeps them
    task: asyncio.Task[None] | None = None
    stop: str | None = None  # why the run was stopped: "cancel", "lost", "shutdown"
    ending: bool = False
    next_seq: int = FIRST_RUN_EVENT
    publisher: Publisher | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    # Set (and replaced) whenever the run's events were kept, and at its end: what a follower on this replica waits
    # on, instead of a blocking read of the event log.
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    def notify(self) -> None:
        self.wake.set()
        self.wake = asyncio.Event()


class TurnRuns:
    """The steps of a run, on what every run of this replica shares."""

    def __init__(
        self,
        *,
        turns: ResponseTurns,
        store: BackgroundStore,
        events: EventLog,
        chat_upstream: Upstream,
        authenticator: Authenticator,
        clock: Clock,
        metrics: Metrics,
        lease_ms: int,
        token: str,
    ) -> None:
        self.turns = turns
        self.store = store
        self.events = events
        self.upstream = chat_upstream
        self.authenticator = authenticator
        self.clock = clock
        self.metrics = metrics
        self.lease_ms = lease_ms
        self.token = token  # this replica's claims

    async def _execute(self, held: Held) -> None:
        job = held.job
        headers = held.headers if held.headers is not None else decode_headers(job.headers)
        prepared = held.prepared
        if prepared is not None:
            principal = prepared.principal
        else:
            turn = read_turn(job.request)
            principal = await self.authenticator.authenticate(headers)
            ttl = next((value for name, value in headers if name == b"statestore-ttl"), None)
            try:
                prepared = await self.turns.prepare(
                    turn, principal, ttl, headers=headers, response_id=job.id, created_at=job.created_ms // 1000
                )
            except OpenAIError as exc:
                await self._end(held, "failed", error={"code": exc.code or "server_error", "message": exc.message})
                return
            held.prepared = prepared
        # Asked for as a stream, its events are published as the backend's chunks come; else the backend answers
        # whole, and the events a stream of it would have had are published once it is stored.
        streamed = prepared.turn.stream
        publisher = held.publisher = Publisher(
            self.events, job.id, job.attempt, prepared.ttl_ms, held.notify, scope=job.scope
        )
        numbered = SequencedEvents()
        numbered.next = held.next_seq
        last = b""
        try:
            summarize = summarizer(self.upstream, headers, principal)
            if not await compact(prepared, summarize, self.turns.seal):
                await prepared.plan_context(summarize)
            upstream = await send_turn(
                self.upstream, headers, principal, prepared, summarize=summarize, windows=self.turns.windows
            )
            try:
                if streamed:
                    guard = functools.partial(self._may_commit, held)
                    events = turn_events(self.turns, prepared, upstream, numbered, announce=False, before_commit=guard)
                    async for frame in events:
                        publisher.add(Event(numbered.next - 1, frame, final=frame.startswith(_FINAL_FRAMES)))
                        held.next_seq = numbered.next
                        last = frame
                else:
                    last = await self._json_turn(held, prepared, upstream, publisher)
            finally:
                await upstream.aclose()
        except Withdrawn:
            # Cancelled meanwhile (it ends so, if the claim is still this replica's), or taken over by another
            # replica (which says how it ended): either way nothing was committed.
            await self._end(held, "cancelled", error=None)
            return
        except OpenAIError as exc:
            await self._end(held, "failed", error={"code": exc.code or "server_error", "message": exc.message})
            return
        except (StreamBrokenOff, StatestoreError) as exc:
            await self._failed(held, str(exc) if isinstance(exc, StreamBrokenOff) else exc.message)
            return
        held.ending = True
        status: BackgroundOutcome = "completed" if last.startswith(b"event: response.completed") else "incomplete"
        await publisher.drain()
        await self.store.end(job.id, token=self.token, status=status, body=None, now_ms=self.clock())
        self.metrics.count_background_turn(status)

    async def _may_commit(self, held: Held) -> None:
        """Just before the commit: the turn must still be this replica's and not asked to be cancelled (a cancel from
        another replica, or one that found the claim run out, may have ended it already); its claim is renewed so
        nobody ends it while the commit is under way. Raises Withdrawn otherwise."""
        now = self.clock()
        if not await self.store.keep_for_commit(
            held.job.id, token=self.token, now_ms=now, until_ms=now + self.lease_ms
        ):
            raise Withdrawn(held.job.id)

    async def _json_turn(
        self, held: Held, prepared: PreparedResponse, upstream: UpstreamResponse, publisher: Publisher
    ) -> bytes:
        """A background turn asked for as JSON: the backend's reply whole, stored, then its events published at once;
        the last frame."""
        raw = await upstream.read()
        try:
            output, status, incomplete, usage = output_of(orjson.loads(raw) if raw else None)
        except orjson.JSONDecodeError:
            raise BackendError("the model backend's reply is not JSON") from None
        response = self.turns.response(
            prepared, status=status, output=with_compaction(prepared, output), usage=usage, incomplete=incomplete
        )
        body = orjson.dumps(response)
        await self._may_commit(held)
        prepared.committing = True  # from here on a cancel lets the turn complete
        try:
            committed = await self.turns.commit(prepared, response, body)
        except DATABASE_ERRORS as exc:
            raise StreamBrokenOff(f"the turn was not committed ({type(exc).__name__})") from exc
        if not committed:
            raise StreamBrokenOff(
                "nothing was stored (the conversation's lease was lost, or the previous response was deleted)"
            )
        frames = run_frames(body, first=held.next_seq)
        for offset, frame in enumerate(frames):
            publisher.add(Event(held.next_seq + offset, frame, final=offset == len(frames) - 1))
        held.next_seq += len(frames)
        return frames[-1]

    async def _failed(self, held: Held, message: str) -> None:
        """The run broke off. Before its commit, it ends `failed`. Once it had begun to commit, the commit may have
        been carried out all the same (its answer lost with the connection, or the run broke off after it): the
        stored response decides, and the turn ends as it was stored; when the database cannot say, the turn is left
        to its claim, which runs out, and whoever claims it next looks again (`_take_over`)."""
        prepared = held.prepared
        if prepared is not None and prepared.committing:
            held.ending = True
            try:
                stored = await self.turns.responses.get(held.job.owner, held.job.id, now_ms=self.clock())
            except Exception as exc:
                log.warning(
                    "a background turn's commit is in doubt; left to its claim",
                    extra={"response_id": held.job.id, "error": type(exc).__name__},
                )
                return
            if stored is not None:
                log.warning("a commit reported as failed had been stored", extra={"response_id": held.job.id})
                await self._finish_stored(held, stored.body)
                return
        await self._end(held, "failed", error={"code": "server_error", "message": message})

    async def _finish_stored(self, held: Held, body: bytes) -> None:
        held.ending = True
        body = completed(body)  # stored by an earlier version, perhaps, before its run was taken over
        status = str(orjson.loads(body).get("status", "completed"))
        if held.publisher is not None:
            with contextlib.suppress(Superseded):
                await held.publisher.drain()
        try:
            last = await self.events.last(held.job.id)
            told = await self.events.read(held.job.id, last[0] - 1, block_ms=0) if last is not None else []
        except EventLogUnavailable:
            last, told = None, []
        seq = last[0] + 1 if last is not None else FIRST_RUN_EVENT
        if not (told and told[-1].final):  # the run had told its end already: it is not told twice
            with contextlib.suppress(Superseded, EventLogUnavailable):
                await self.events.publish(
                    held.job.id,
                    held.job.attempt,
                    [Event(seq, final_frame(body, seq), final=True)],
                    self._ttl(held.job),
                    scope=held.job.scope,
                )
        await self.store.end(held.job.id, token=self.token, status=status, body=None, now_ms=self.clock())
        self.metrics.count_background_turn("completed" if status == "completed" else "incomplete")

    def _ttl(self, job: BackgroundJob) -> int:
        return max(job.expires_ms - self.clock(), 1000)

    async def _end(self, held: Held, status: BackgroundOutcome, *, error: dict[str, str] | None) -> None:
        """End a turn that stored nothing: its final Response kept in its row, its final event published."""
        held.ending = True
        job = held.job
        if held.publisher is not None:
            with contextlib.suppress(Superseded):
                await held.publisher.drain()
        body = with_status(job.body, status, error)
        ended = await self.store.end(
            job.id, token=self.token, status=status, body=body, now_ms=self.clock(), scope=job.scope
        )
        if not ended:
            return  # the claim was lost: the replica that holds it says how the turn ended
        seq = held.next_seq
        with contextlib.suppress(Superseded, EventLogUnavailable):
            await self.events.publish(
                job.id, job.attempt, [Event(seq, final_frame(body, seq), final=True)], self._ttl(job), scope=job.scope
            )
        self.metrics.count_background_turn(status)
        if held.prepared is None and job.conversation_id is not None and job.conversation_lease is not None:
            # A turn taken over from a replica that stopped: nothing of this run holds the lease its admission took
            # on the conversation, which is free again now.
            await self.turns.leased_log.release(CONVERSATIONS, job.conversation_id, job.conversation_lease)
