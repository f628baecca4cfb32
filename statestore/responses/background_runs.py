"""The background turns this replica runs (RESPONSES.md, "Turns that outlive their connection").

Every replica runs a loop that (a) looks at the database for cancels asked of the turns it holds, from any replica,
four times a second; (b) renews its claims on them every third of the lease, and stops any whose claim it lost; (c)
claims turns no live claim holds (queued, or left by a replica that stopped) while it has workers free. A turn it
claims from a replica that stopped is run again only when that run had published nothing of its own; else it ends
`failed`, so no client ever reads a stream that mixes two runs. The run itself is a foreground streamed turn's
(responses/turn_events.py), its events published to the event log instead of a socket.

A cancel stops a run before its commit (closing the backend call); a run already committing completes, and a cancel
then finds it completed."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from dataclasses import dataclass, field

import orjson

from statestore.auth import Authenticator
from statestore.clock import Clock
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
from statestore.responses.stream import SequencedEvents
from statestore.responses.turn_events import turn_events, with_compaction
from statestore.responses.turns import ResponseTurns
from statestore.store.background_store import BackgroundJob, BackgroundStore
from statestore.store.engine import DATABASE_ERRORS
from statestore.store.event_log import Event, EventLog, EventLogUnavailable, Superseded
from statestore.threads.ids import new_lease_token
from statestore.upstream.client import Upstream, UpstreamResponse

log = logging.getLogger(__name__)

# The events sent when a turn is queued (response.created, response.queued); a run's own start after them.
FIRST_RUN_EVENT = 2
CANCEL_CHECK_SECONDS = 0.25
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


class BackgroundRunner:
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
        lease_seconds: int,
        workers: int,
        poll_seconds: float,
    ) -> None:
        self.turns = turns
        self.store = store
        self.events = events
        self.upstream = chat_upstream
        self.authenticator = authenticator
        self.clock = clock
        self.metrics = metrics
        self.lease_ms = lease_seconds * 1000
        self.workers = workers
        self.poll_seconds = poll_seconds
        self.token = new_lease_token()
        self.held: dict[str, Held] = {}
        self._slots = asyncio.Semaphore(max(workers, 1))
        self._loop: asyncio.Task[None] | None = None

    # -- the replica's loop ----------------------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop().create_task(self._watch(), name="background-runner")

    def has_room(self) -> bool:
        return sum(1 for held in self.held.values() if held.started) < self.workers

    async def _watch(self) -> None:
        renew_every = self.lease_ms / 3000
        next_renew = next_claim = time.monotonic()
        while True:
            await asyncio.sleep(CANCEL_CHECK_SECONDS)
            now = time.monotonic()
            try:
                if self.held:
                    for response_id in await self.store.cancels(list(self.held)):
                        self.stop_local(response_id, "cancel")
                if self.held and now >= next_renew:
                    next_renew = now + renew_every
                    await self._renew()
                if now >= next_claim:
                    next_claim = now + self.poll_seconds
                    await self._claim_free()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the database away: the claims still run for a while; try again
                log.warning("background runner could not reach the database", extra={"error": type(exc).__name__})

    async def _renew(self) -> None:
        ids = [response_id for response_id, held in self.held.items() if not held.ending]
        now = self.clock()
        kept = await self.store.renew(self.token, ids, now_ms=now, until_ms=now + self.lease_ms)
        for response_id in ids:
            if response_id not in kept:
                self.stop_local(response_id, "lost")

    async def _claim_free(self) -> None:
        room = self.workers - sum(1 for held in self.held.values() if held.started)
        if room <= 0:
            return
        now = self.clock()
        for response_id in await self.store.claimable(now_ms=now, limit=room):
            job = await self.store.claim(response_id, token=self.token, now_ms=now, until_ms=now + self.lease_ms)
            if job is not None:
                await self._take_over(job)

    async def _take_over(self, job: BackgroundJob) -> None:
        """A turn just claimed: queued, or left in progress by a replica that stopped."""
        held = Held(job, started=True)
        if job.cancel_requested:
            await self._end(held, "cancelled", error=None)
            return
        if job.status == "in_progress":
            stored = await self.turns.responses.get(job.owner, job.id, now_ms=self.clock())
            if stored is not None:
                # The run committed and stopped before it said so: the turn is done.
                await self._finish_stored(held, stored.body)
                return
            try:
                last = await self.events.last(job.id)
            except EventLogUnavailable:
                last = None
            if last is None or last[0] >= FIRST_RUN_EVENT:
                # It had published events of its own (or nothing shows that it had not): a second run would mix them.
                held.next_seq = (last[0] + 1) if last is not None else FIRST_RUN_EVENT
                await self._end(
                    held,
                    "failed",
                    error={"code": "server_error", "message": "The replica running this response stopped."},
                )
                return
            self.metrics.count_background_turn("rerun")
        self.launch(held)

    def stop_local(self, response_id: str, why: str) -> None:
        """Stop a run this replica holds, unless it is committing (it then completes)."""
        held = self.held.get(response_id)
        if held is None or held.ending or held.task is None:
            return
        prepared = held.prepared
        if prepared is not None and prepared.committing:
            return
        if held.stop is None:
            held.stop = why
            held.task.cancel()

    async def aclose(self, grace_seconds: float) -> None:
        """Stop claiming; let running turns finish for `grace_seconds`, then hand the rest back for another replica
        (a run that had published events of its own is then ended `failed` by whoever claims it)."""
        if self._loop is not None:
            self._loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop
        running = [held.task for held in self.held.values() if held.task is not None and held.started]
        if running:
            await asyncio.wait(running, timeout=grace_seconds)
        for response_id in list(self.held):
            self.stop_local(response_id, "shutdown")
        left = [held.task for held in self.held.values() if held.task is not None]
        if left:
            await asyncio.wait(left, timeout=5)

    # -- one run ---------------------------------------------------------------------------------------------------

    def launch(self, held: Held) -> None:
        self.held[held.job.id] = held
        held.task = asyncio.get_running_loop().create_task(self._run(held), name="background-turn")

    async def _run(self, held: Held) -> None:
        job = held.job
        try:
            async with self._slots:
                if not held.started:
                    now = self.clock()
                    if not await self.store.start(job.id, token=self.token, now_ms=now):
                        return  # cancelled or taken over while it waited
                    held.started = True
                await self._execute(held)
        except asyncio.CancelledError:
            await self._stopped(held)
        except Superseded:
            log.warning("background turn taken over by another run", extra={"response_id": job.id})
        except Exception:
            log.exception("background turn failed", extra={"response_id": job.id})
            with contextlib.suppress(Exception):
                await self._failed(held, "The response failed.")
        finally:
            if held.prepared is not None:
                with contextlib.suppress(Exception):
                    await self.turns.give_back(held.prepared)
            self.held.pop(job.id, None)
            held.done.set()
            held.notify()

    async def _stopped(self, held: Held) -> None:
        """The run was stopped before its commit: say so, unless the claim is another replica's now."""
        if held.stop == "cancel":
            await asyncio.shield(self._end(held, "cancelled", error=None))
        elif held.stop == "shutdown":
            # Handed back: whoever claims it next runs it again, or ends it failed if this run had published.
            now = self.clock()
            await asyncio.shield(self.store.release(held.job.id, token=self.token, now_ms=now))

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
                    turn, principal, ttl, response_id=job.id, created_at=job.created_ms // 1000
                )
            except OpenAIError as exc:
                await self._end(held, "failed", error={"code": exc.code or "server_error", "message": exc.message})
                return
            held.prepared = prepared
        # Asked for as a stream, its events are published as the backend's chunks come; else the backend answers
        # whole, and the events a stream of it would have had are published once it is stored.
        streamed = prepared.turn.stream
        publisher = held.publisher = Publisher(self.events, job.id, job.attempt, prepared.ttl_ms, held.notify)
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
            raise StreamBrokenOff("the conversation's lease was lost")
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
                    held.job.id, held.job.attempt, [Event(seq, final_frame(body, seq), final=True)], self._ttl(held.job)
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
        if not await self.store.end(job.id, token=self.token, status=status, body=body, now_ms=self.clock()):
            return  # the claim was lost: the replica that holds it says how the turn ended
        seq = held.next_seq
        with contextlib.suppress(Superseded, EventLogUnavailable):
            await self.events.publish(
                job.id, job.attempt, [Event(seq, final_frame(body, seq), final=True)], self._ttl(job)
            )
        self.metrics.count_background_turn(status)
