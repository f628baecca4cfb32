"""Background responses as the Responses door serves them (docs/responses.md, "Background responses"):
admit a turn (answered at once, `queued`), tell where one stands, cancel one, and follow one's events from any
replica. The runs themselves are responses/background_runs.py's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import orjson

from statestore.auth import Principal
from statestore.clock import Clock
from statestore.content_keys import Scope
from statestore.core.leased_log import CONVERSATIONS
from statestore.core.policy_enforcement import TurnMeasures
from statestore.responses.background_events import final_frame, with_status
from statestore.responses.background_runs import BackgroundRunner
from statestore.responses.background_turn import Held
from statestore.responses.errors import BadRequest, RateLimited, response_not_found
from statestore.responses.replay import queued_frames, replayed_frames
from statestore.responses.request import TurnRequest
from statestore.responses.response_object import completed
from statestore.responses.turns import ResponseTurns, enforced
from statestore.store.background_store import BackgroundJob, BackgroundStore, NewJob
from statestore.store.event_log import Event, EventLog, EventLogUnavailable, Superseded

log = logging.getLogger(__name__)

# What a replica needs to run the turn as its client would have: the credential, and the TTL asked for.
_KEPT_HEADERS = (b"authorization", b"x-api-key", b"statestore-ttl")
FOLLOW_WAIT_MS = 1000
CANCEL_WAIT_SECONDS = 5.0


class BackgroundTurns:
    def __init__(
        self, *, turns: ResponseTurns, store: BackgroundStore, events: EventLog, runner: BackgroundRunner, clock: Clock
    ) -> None:
        self.turns = turns
        self.store = store
        self.events = events
        self.runner = runner
        self.clock = clock

    async def admit(
        self,
        turn: TurnRequest,
        principal: Principal,
        headers: list[tuple[bytes, bytes]],
        raw: bytes,
        *,
        response_id: str | None = None,
    ) -> tuple[str, bytes, list[bytes]]:
        """Queue the turn: (its id, the Response as queued, the events that said so: response.created,
        response.queued). `response_id`: the id an Idempotency-Key's claim named for it."""
        policy = await self.turns.policy(principal, storing=True)
        enforced(policy, TurnMeasures(background=True))
        bound = policy.max_background_turns  # counted and checked as the turn is queued (BackgroundStore.admit)
        ttl = next((value for name, value in headers if name == b"statestore-ttl"), None)
        # The same checks as a foreground turn, answered now: the previous response, the conversation and its lease.
        prepared = await self.turns.prepare(turn, principal, ttl, headers=headers, response_id=response_id)
        runner = self.runner
        # A turn on a conversation holds its lease while it waits, so it waits here, for a worker of this replica.
        room = runner.has_room()
        claimed = room or (turn.conversation_id is not None and runner.workers > 0)
        now = self.clock()
        body = orjson.dumps(self.turns.response(prepared, status="queued", output=[], usage=None))
        job = NewJob(
            id=prepared.response_id,
            owner=principal.owner,
            tenant_id=principal.tenant_id,
            metadata_user_id=turn.metadata.get("user_id"),
            conversation_id=turn.conversation_id,
            conversation_lease=prepared.lease,
            request=raw,
            headers=orjson.dumps(
                [[name.decode("latin-1"), value.decode("latin-1")] for name, value in headers if name in _KEPT_HEADERS]
            ),
            body=body,
            now_ms=now,
            expires_ms=now + prepared.ttl_ms,
        )
        try:
            admitted = await self.store.admit(
                job,
                bound=bound,
                claim_token=runner.token if claimed else None,
                claim_until_ms=now + runner.lease_ms,
                started=room,
            )
        except BaseException:
            await self.turns.give_back(prepared)
            raise
        if admitted is None:
            await self.turns.give_back(prepared)
            raise RateLimited(
                f"Too many background responses queued or running at once (this deployment allows {bound}); try "
                "again when one has finished.",
                param="background",
                code="rate_limit_exceeded",
            )
        frames = queued_frames(body)
        try:
            await self.events.publish(
                job.id,
                0,
                [Event(0, frames[0]), Event(1, frames[1])],
                ttl_ms=max(prepared.ttl_ms, 1000),
                scope=Scope(job.owner, job.tenant_id, job.metadata_user_id),
            )
        except (EventLogUnavailable, Superseded) as exc:
            log.warning("background events not kept", extra={"response_id": job.id, "error": str(exc)})
        if claimed:
            runner.launch(Held(admitted, started=room, prepared=prepared, headers=headers))
        else:
            await self.turns.hand_over(prepared)
        return job.id, body, frames

    async def state(self, owner: str, response_id: str) -> tuple[BackgroundJob, bytes] | None:
        """A background response and its Response as of now; None when the owner has no such background response."""
        now = self.clock()
        job = await self.store.get(owner, response_id, now_ms=now)
        if job is None:
            return None
        if job.status in ("completed", "incomplete"):
            row = await self.turns.responses.get(owner, response_id, now_ms=now)
            return (job, completed(row.body)) if row is not None else None
        return job, with_status(job.body, job.status) if job.open else completed(job.body)

    async def cancel(self, owner: str, response_id: str) -> bytes:
        """Cancel a queued or running background turn (from any replica), and the Response as it ended; a finished
        one is returned as it is."""
        now = self.clock()
        status = await self.store.request_cancel(owner, response_id, now_ms=now)
        held = self.runner.held.get(response_id)
        if held is not None:
            self.runner.stop_local(response_id, "cancel")
            # A run that does not stop in time (the database hanging as it ends) is answered as it stands.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(held.done.wait()), CANCEL_WAIT_SECONDS)
        elif status is not None and not (status == "queued" and await self._cancel_unclaimed(owner, response_id)):
            # Held by another replica (running, or queued for a worker there), which looks for cancels four times a
            # second.
            deadline = time.monotonic() + CANCEL_WAIT_SECONDS
            while time.monotonic() < deadline:
                found = await self.store.get(owner, response_id, now_ms=self.clock())
                if found is None or not found.open:
                    break
                await asyncio.sleep(0.05)
        found_state = await self.state(owner, response_id)
        if found_state is None:
            if await self.turns.responses.get(owner, response_id, now_ms=self.clock()) is not None:
                raise BadRequest("Only responses created with background=true can be cancelled.", param="response_id")
            raise response_not_found(response_id)
        return found_state[1]

    async def forget(self, owner: str, response_id: str) -> bool:
        """Delete a background response's own row (a run of it stops: its claim is gone); False when there was none."""
        if await self.store.request_cancel(owner, response_id, now_ms=self.clock()) is not None:
            self.runner.stop_local(response_id, "cancel")
        return await self.store.delete(owner, response_id)

    async def _cancel_unclaimed(self, owner: str, response_id: str) -> bool:
        """End a turn no replica holds: a queued one as cancelled here, one a stopped run left in progress through a
        take-over; False when a replica holds it (it then sees the cancel itself)."""
        job = await self.store.get(owner, response_id, now_ms=self.clock())
        if job is None:
            return False
        if job.status == "in_progress":
            # Its run stopped (its replica gone, or the run broke off): taken over here, it ends as the take-over
            # decides for any such turn, as stored when its run had committed (a cancel never undoes a commit), else
            # cancelled.
            return await self.runner.take_over(response_id)
        body = with_status(job.body, "cancelled")
        ended = await self.store.end_unclaimed(
            response_id, status="cancelled", body=body, now_ms=self.clock(), scope=job.scope
        )
        if ended is None:
            return False
        if ended.conversation_id is not None and ended.conversation_lease is not None:
            await self.turns.leased_log.release(CONVERSATIONS, ended.conversation_id, ended.conversation_lease)
        try:
            last = await self.events.last(response_id)
            seq = last[0] + 1 if last is not None else 2
            frame = final_frame(body, seq)
            await self.events.publish(
                response_id, ended.attempt + 1, [Event(seq, frame, final=True)], 60_000, scope=ended.scope
            )
        except (EventLogUnavailable, Superseded):
            pass
        self.runner.metrics.count_background_turn("cancelled")
        return True

    async def follow(self, owner: str, response_id: str, after: int) -> AsyncIterator[bytes]:
        """The events of a background response numbered above `after`, live until its final event. When its events
        are gone, what is stored tells the rest: all of it to a client that saw nothing of the run (when none of the
        run's events are left after what it saw), else the final Response."""
        last = after
        wait_ms = 0  # the first look does not wait: a finished response whose events are gone is told at once
        while True:
            # A run on this replica wakes its followers itself when its events are kept: no blocking read then.
            held = self.runner.held.get(response_id)
            wake = held.wake if held is not None and not held.done.is_set() else None
            try:
                events = await self.events.read(response_id, last, block_ms=0 if wake is not None else wait_ms)
                wait_ms = FOLLOW_WAIT_MS
                known = True
            except EventLogUnavailable:
                events, known = [], False
                await asyncio.sleep(FOLLOW_WAIT_MS / 1000)
            if events and events[0].seq == last + 1:
                for event in events:
                    if event.seq != last + 1:
                        break  # a gap: the stream was cut; what is stored tells the rest
                    yield event.frame
                    last = event.seq
                    if event.final:
                        return
                else:
                    continue
            if wake is not None and not events:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), FOLLOW_WAIT_MS / 1000)
                continue
            found = await self.state(owner, response_id)
            if found is None:
                return  # deleted or expired meanwhile
            job, body = found
            if job.open:
                if events:
                    await asyncio.sleep(FOLLOW_WAIT_MS / 1000)
                wait_ms = FOLLOW_WAIT_MS
                continue
            # The whole story from storage, numbered its own way, only when the log is known to hold nothing after
            # `last`: else a later resume would read the run's own events, numbered as the run numbered them, on
            # top of it (a stream that tells the reply twice).
            if last <= 1 and known and not events:
                for frame in replayed_frames(body, after=last):
                    yield frame
            else:
                yield final_frame(body, last + 1)
            return
