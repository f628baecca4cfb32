"""The erasures a process runs (docs/administration.md#erasure), as durable work.

An erasure is claimed in its row (store/erasure_log.py) by the process running it, which renews the claim every third
of the lease (STATESTORE_LEASE_SECONDS) while the erasure runs, recording what it erased so far. A server looks, as it
starts and every third of the lease after, for running erasures whose claim ran out (their process was killed, or
lost the database for a lease) and takes each up. Erasing is idempotent: run again, an erasure deletes what is left,
and waits out what replicas remember of its data keys as if it had destroyed them itself (the process that stopped may
have destroyed them moments before). So an erasure answered `running` always ends `done` or `failed`.

An erasure that stops on an error (the database away a moment, a replica's Redis down) is `failed`, and run again by
the same look once its retry is due: a lease after its first run, then twice as long after each further failure
(capped at RETRY_DELAY_CAP_MS), for MAX_ATTEMPTS runs in all, each taken up as above. After the last it stays
`failed`, logged at error level, for an operator to send it again."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from statestore.clock import Clock
from statestore.retention import ErasureProgress, Retention
from statestore.store.erasure_log import ErasureLog, ErasureState
from statestore.store.retention_queries import Erasure
from statestore.threads.ids import new_lease_token

log = logging.getLogger(__name__)

NOTHING = Erasure(threads=0, responses=0, conversations=0)
# A server takes up at most this many erasures per look; more wait for its next look, or another replica's.
TAKE_UP_AT_ONCE = 8
# Runs of a failing erasure, the first included, before it stays failed. Not a setting: the delays scale with
# STATESTORE_LEASE_SECONDS, and with the default lease the retries span about an hour (2, 4, 8, 16, 32 minutes), the
# length of a database failover or a maintenance window; an erasure failing for longer needs a person anyway.
MAX_ATTEMPTS = 6
RETRY_DELAY_CAP_MS = 3_600_000


def retry_delay_ms(lease_ms: int, attempts: int) -> int:
    """How long a failed erasure waits after its `attempts`-th run: a lease, doubled for each further run, capped."""
    return min(lease_ms << max(attempts - 1, 0), RETRY_DELAY_CAP_MS)


def _sum(before: Erasure, now: Erasure | ErasureProgress) -> Erasure:
    return Erasure(
        threads=before.threads + now.threads,
        responses=before.responses + now.responses,
        conversations=before.conversations + now.conversations,
    )


class ErasureRuns:
    def __init__(self, erasures: ErasureLog, retention: Retention, *, clock: Clock, lease_seconds: int) -> None:
        self.records = erasures
        self.retention = retention
        self.clock = clock
        self.lease_ms = lease_seconds * 1000
        self.token = new_lease_token()
        # The erasures running here in the background (the admin API's, the console's, those taken up), by id.
        self._running: dict[str, asyncio.Task[None]] = {}
        self._watch: asyncio.Task[None] | None = None

    async def begin(self, state: ErasureState) -> None:
        """Record a new erasure, claimed by this process."""
        await self.records.begin(state, token=self.token, until_ms=self.clock() + self.lease_ms)

    def start(self, state: ErasureState, *, so_far: Erasure = NOTHING, resumed: bool = False) -> None:
        """Run a claimed erasure in the background."""
        task = asyncio.create_task(self._in_background(state, so_far, resumed), name=f"erasure {state.id}")
        self._running[state.id] = task
        task.add_done_callback(lambda _: self._running.pop(state.id, None))

    async def _in_background(self, state: ErasureState, so_far: Erasure, resumed: bool) -> None:
        with contextlib.suppress(Exception):  # logged and recorded as failed by run()
            await self.run(state, so_far=so_far, resumed=resumed)

    async def run(self, state: ErasureState, *, so_far: Erasure = NOTHING, resumed: bool = False) -> ErasureState:
        """Run a claimed erasure to its end, renewing its claim meanwhile; `so_far`: what earlier runs erased."""
        progress = ErasureProgress()
        keeper = asyncio.create_task(self._keep(state.id, so_far, progress), name=f"erasure claim {state.id}")
        try:
            erased = await self.retention.erase(
                actor=state.actor,
                tenant_id=state.tenant_id,
                user_id=state.user_id,
                progress=progress,
                resumed=resumed,
            )
        except Exception as exc:
            await self._failed(state, exc, _sum(so_far, progress))
            raise
        finally:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
        total = _sum(so_far, erased)
        finished = self.clock()
        if not await self.records.finish(state.id, total, now_ms=finished):
            # Another run (its claim taken over while this one was cut off from the database) finished it first.
            return await self.records.get(state.id) or state
        return ErasureState(
            id=state.id,
            actor=state.actor,
            tenant_id=state.tenant_id,
            user_id=state.user_id,
            status="done",
            created_ms=state.created_ms,
            finished_ms=finished,
            erased=total,
            attempts=state.attempts,
        )

    async def _failed(self, state: ErasureState, exc: Exception, so_far: Erasure) -> None:
        """Record the erasure failed, with when it is run again, or never after its last attempt."""
        now = self.clock()
        # Its type only: an error may quote a stored value. Run again, an erasure takes up what is left.
        failure = {"erasure": state.id, "error": type(exc).__name__, "attempts": state.attempts}
        retry_at: int | None = None
        if state.attempts >= MAX_ATTEMPTS:
            log.error("erasure failed for good", extra=failure)
        else:
            delay = retry_delay_ms(self.lease_ms, state.attempts)
            retry_at = now + delay
            log.warning("erasure failed, to be retried", extra={**failure, "retry_in_s": delay / 1000})
        try:
            await self.records.fail(state.id, token=self.token, now_ms=now, so_far=so_far, retry_at_ms=retry_at)
        except Exception as recording:  # its claim runs out, and it is taken up as a stopped erasure
            log.error("erasure failure not recorded", extra={"erasure": state.id, "error": type(recording).__name__})

    async def _keep(self, erasure_id: str, so_far: Erasure, progress: ErasureProgress) -> None:
        interval = self.lease_ms / 3000
        while True:
            await asyncio.sleep(interval)
            now = self.clock()
            try:
                kept = await self.records.renew(
                    erasure_id, token=self.token, until_ms=now + self.lease_ms, so_far=_sum(so_far, progress)
                )
            except Exception as exc:  # a database hiccup: the claim still runs; try again at the next interval
                log.warning(
                    "could not renew an erasure's claim", extra={"erasure": erasure_id, "error": type(exc).__name__}
                )
                continue
            if not kept:
                # Taken up elsewhere after the claim ran out. This run goes on (erasing is idempotent); whichever
                # finishes first marks it done.
                log.warning("erasure's claim taken over", extra={"erasure": erasure_id})
                return

    # -- taking up erasures whose process stopped ------------------------------------------------------------------

    def watch(self) -> None:
        """Take up stopped erasures now and every third of the lease, until aclose()."""
        self._watch = asyncio.get_running_loop().create_task(self._watching(), name="erasure-runs")

    async def _watching(self) -> None:
        interval = min(self.lease_ms / 3000, 10.0)
        while True:
            try:
                await self.take_up()
            except Exception as exc:  # the database away: look again next time
                log.warning("could not look for stopped erasures", extra={"error": type(exc).__name__})
            await asyncio.sleep(interval)

    async def take_up(self) -> int:
        """Claim the running erasures whose claim ran out, and the failed ones whose retry is due, and run each here;
        how many."""
        now = self.clock()
        unclaimed_since = now - self.lease_ms
        found = await self.records.claimable(now_ms=now, unclaimed_since_ms=unclaimed_since, limit=TAKE_UP_AT_ONCE)
        taken = 0
        for erasure_id, status in found:
            if erasure_id in self._running:  # its claim ran out while it runs here (the database was away)
                continue
            claimed = await self.records.claim(
                erasure_id,
                token=self.token,
                now_ms=now,
                until_ms=now + self.lease_ms,
                unclaimed_since_ms=unclaimed_since,
                retry=status == "failed",
            )
            if claimed is None:  # another replica took it up first
                continue
            state, so_far = claimed
            if status == "failed":
                log.info("erasure retried", extra={"erasure": state.id, "attempts": state.attempts})
            else:
                log.info("erasure taken up", extra={"erasure": state.id})
            # Resumed either way: the run that failed may have destroyed data keys replicas still remember.
            self.start(state, so_far=so_far, resumed=True)
            taken += 1
        return taken

    async def aclose(self) -> None:
        """Stop looking, and stop the erasures still running here: each stays `running`, handed back so that another
        replica takes it up at once."""
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        running = list(self._running.items())
        for _, task in running:
            task.cancel()
        await asyncio.gather(*(task for _, task in running), return_exceptions=True)
        for erasure_id, _ in running:
            try:
                await self.records.release(erasure_id, token=self.token, now_ms=self.clock())
            except Exception as exc:  # its claim runs out by itself
                log.warning(
                    "could not hand an erasure back", extra={"erasure": erasure_id, "error": type(exc).__name__}
                )
