"""The background turns this replica runs (docs/responses.md, "Background responses").

Every replica runs a loop that (a) looks at the database for cancels asked of the turns it holds, from any replica,
four times a second; (b) renews its claims on them every third of the lease, and stops any whose claim it lost; (c)
claims turns no live claim holds (queued, or left by a replica that stopped) while it has workers free. A turn it
claims from a replica that stopped is run again only when that run had published nothing of its own; else it ends
`failed`, so no client ever reads a stream that mixes two runs. The run itself is responses/background_turn.py's.

A cancel stops a run before its commit (closing the backend call); a run already committing completes, and a cancel
then finds it completed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from statestore.auth import Authenticator
from statestore.clock import Clock
from statestore.metrics import Metrics
from statestore.responses.background_turn import FIRST_RUN_EVENT, Held, TurnRuns
from statestore.responses.turns import ResponseTurns
from statestore.store.background_store import BackgroundJob, BackgroundStore
from statestore.store.event_log import EventLog, EventLogUnavailable, Superseded
from statestore.threads.ids import new_lease_token
from statestore.upstream.client import Upstream

log = logging.getLogger(__name__)

CANCEL_CHECK_SECONDS = 0.25


class BackgroundRunner(TurnRuns):
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
        super().__init__(
            turns=turns,
            store=store,
            events=events,
            chat_upstream=chat_upstream,
            authenticator=authenticator,
            clock=clock,
            metrics=metrics,
            lease_ms=lease_seconds * 1000,
            token=new_lease_token(),
        )
        self.workers = workers
        self.poll_seconds = poll_seconds
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
            await self.take_over(response_id)

    async def take_over(self, response_id: str) -> bool:
        """Claim a turn no live claim holds and end or run it here; False when another replica claimed it first."""
        now = self.clock()
        job = await self.store.claim(response_id, token=self.token, now_ms=now, until_ms=now + self.lease_ms)
        if job is None:
            return False
        await self._take_over(job)
        return True

    async def _take_over(self, job: BackgroundJob) -> None:
        """A turn just claimed: queued, or left in progress by a replica that stopped (the one place that decides how
        such a turn ends, whether a worker claimed it or a cancel of it did)."""
        held = Held(job, started=True)
        last: tuple[int, int] | None = None
        if job.status == "in_progress":
            stored = await self.turns.responses.get(job.owner, job.id, now_ms=self.clock())
            if stored is not None:
                # The run committed and stopped before it said so: the turn is done, as stored, even when a cancel
                # came meanwhile (a cancel never undoes a commit).
                await self._finish_stored(held, stored.body)
                return
        if job.status == "in_progress" or job.cancel_requested:
            # The turn ends here: its final event goes after the events it has.
            try:
                last = await self.events.last(job.id)
            except EventLogUnavailable:
                last = None
            held.next_seq = (last[0] + 1) if last is not None else FIRST_RUN_EVENT
        if job.cancel_requested:
            await self._end(held, "cancelled", error=None)
            return
        if job.status == "in_progress":
            if last is None or last[0] >= FIRST_RUN_EVENT:
                # It had published events of its own (or nothing shows that it had not): a second run would mix them.
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
