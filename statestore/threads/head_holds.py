"""How a threaded turn holds its thread's head: the database's lease, a Redis claim (store/thread_claims.py), or
both: taken for a continue by response id, kept while the reply runs, given back; and after a commit whose answer was
lost, fenced so that whether the turn was stored can be read. The turn itself (threads/service.py) only says which it
holds (PreparedTurn.claim)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import anyio

from statestore.core.lease_keeper import LeaseKeeper
from statestore.core.leased_log import THREADS, LeasedLog
from statestore.core.lost_commit import settle_lost_commit
from statestore.metrics import Metrics
from statestore.records import record
from statestore.store.cache import HistoryCache
from statestore.store.cache_entry import CachedHistory, thread_key
from statestore.store.engine import DATABASE_ERRORS
from statestore.store.thread_claims import CLAIM_FAULTS, HeadClaims, claim_name
from statestore.store.thread_store import ThreadStore
from statestore.store.turn_records import LeasedThread, NewThread
from statestore.threads import rules
from statestore.threads.ids import new_lease_token
from statestore.threads.prepared import HeadClaim, PreparedTurn

log = logging.getLogger(__name__)


@record
class Held:
    """A continue's thread, held: the row (from the database's lease, or from Redis with a claim), the history cached
    at the same time, and the claim when there is one."""

    leased: LeasedThread
    cached: CachedHistory | None
    claim: HeadClaim | None


class HeadHolds:
    def __init__(
        self,
        *,
        leased_log: LeasedLog,
        repository: ThreadStore,
        cache: HistoryCache,
        claims: HeadClaims | None,
        metrics: Metrics,
        lease_ms: int,
        clock: Callable[[], int],
    ) -> None:
        self.leased_log = leased_log
        self.repository = repository
        self.cache = cache
        self.claims = claims
        self.metrics = metrics
        self.lease_ms = lease_ms
        self.clock = clock

    async def take_by_response(self, *, thread_id: str, owner: str, response_id: str, token: str, now: int) -> Held:
        """The head `response_id` names, held by `token`: claimed in Redis when claims are on and Redis answers,
        with the row from there when it is the cached head's, else leased in the database as well; leased alone
        otherwise. Raises the refusal (a thread error) with nothing held when the head cannot be taken."""
        if self.claims is not None:
            held = await self._claim(self.claims, thread_id, owner=owner, response_id=response_id, token=token, now=now)
            if held is not None:
                return held
        # The cached history is read (in a task) while the lease is taken; its count is checked against the head.
        reading = asyncio.ensure_future(self.cache.get(thread_key(thread_id)))
        try:
            leased = await self._lease(thread_id, owner=owner, head=response_id, token=token, now=now)
        except BaseException:
            reading.cancel()
            raise
        cached = await reading
        if leased is None:
            raise await self._refusal(owner, thread_id, response_id, now)
        self.metrics.count_thread_head("lease")
        return Held(leased=leased, cached=cached, claim=None)

    async def _claim(
        self, claims: HeadClaims, thread_id: str, *, owner: str, response_id: str, token: str, now: int
    ) -> Held | None:
        """None when Redis cannot be reached: the caller leases as before."""
        try:
            claim = await claims.claim(
                thread_id, owner=owner, response_id=response_id, token=token, lease_ms=self.lease_ms, now_ms=now
            )
        except CLAIM_FAULTS as exc:
            log.debug("could not claim a thread head in redis", extra={"error": type(exc).__name__})
            return None
        if not claim.held:
            raise await self._refusal(owner, thread_id, response_id, now)
        name = claim_name(response_id, owner)
        if claim.row is not None:
            self.metrics.count_thread_head("claim")
            return Held(leased=claim.row, cached=claim.cached, claim=HeadClaim(response_id, leased=False, name=name))
        # The row is not served from Redis: the database's lease too, the claim kept (a claimed turn beside this one
        # would only lose its commit).
        try:
            leased = await self._lease(thread_id, owner=owner, head=response_id, token=token, now=now)
            if leased is None:
                raise await self._refusal(owner, thread_id, response_id, now)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.give_back(thread_id, token, claim=HeadClaim(response_id, leased=False, name=name))
            raise
        self.metrics.count_thread_head("claim_and_lease")
        return Held(leased=leased, cached=claim.cached, claim=HeadClaim(response_id, leased=True, name=name))

    async def _lease(self, thread_id: str, *, owner: str, head: str, token: str, now: int) -> LeasedThread | None:
        """The database's lease on `head`, for `token`; None when it is not free (or not there)."""
        return await self.leased_log.take_thread(
            owner=owner, thread_id=thread_id, head=head, token=token, now_ms=now, until_ms=now + self.lease_ms
        )

    async def _refusal(self, owner: str, thread_id: str, response_id: str, now: int) -> Exception:
        reason = await self.repository.why_not_continuable(
            owner=owner, thread_id=thread_id, response_id=response_id, now_ms=now
        )
        return rules.refusal(reason)

    def keep(self, thread_id: str, token: str, *, claim: HeadClaim | None = None, owner: str = "") -> LeaseKeeper:
        """A started keeper of what `token` holds on the thread, renewing it every third of its length; lost is the
        lease lost. A turn that holds only a claim takes the database's lease on its head at its first renewal: a
        turn that long then keeps the thread from the purger and commits past the thread's expiry, by the lease, as
        a leased turn does."""
        claims = self.claims if claim is not None else None

        async def renew() -> bool:
            if claims is not None and claim is not None:
                if not claim.leased:
                    claim.leased = True  # before it is asked: a turn cancelled meanwhile gives back what it may hold
                    now = self.clock()
                    leased = await self._lease(thread_id, owner=owner, head=claim.head, token=token, now=now)
                    if leased is None:  # the head moved, or another turn leased it: this one cannot commit
                        return False
                # The lease is what guards this turn; the claim beside it only keeps claimed turns away.
                with contextlib.suppress(*CLAIM_FAULTS):
                    await claims.renew(thread_id, claim.name, token, self.lease_ms)
            return await self.leased_log.renew(THREADS, thread_id, token, until_ms=self.clock() + self.lease_ms)

        keeper = LeaseKeeper(renew, interval=self.lease_ms / 3000, thread_id=thread_id)
        keeper.start()
        return keeper

    async def settle_lost_commit(self, prepared: PreparedTurn, error: BaseException) -> bool:
        """A commit whose connection failed, settled as every door settles one (core/lost_commit.py): the thread's
        fence is its head given back (a create's row abandoned), so a commit still on its way finds its lease gone and
        changes nothing; then the reply's row decides. Returns True (stored) or raises ServiceUnavailable."""

        async def fence() -> str | None:
            if prepared.creating:
                await self.repository.abandon_create(thread_id=prepared.thread_id, token=prepared.lease_token)
                return None
            return await self._fence(prepared)

        async def not_stored(fenced: str | None) -> None:
            prepared.outcome = "given_back"
            self.metrics.count_thread_turn("create" if prepared.creating else "continue", "not_stored")
            if prepared.claim is not None:
                await self.give_back(prepared.thread_id, prepared.lease_token, claim=prepared.claim, lease=False)
            if fenced is not None:
                await self.give_back(prepared.thread_id, fenced)

        return await settle_lost_commit(
            error,
            fence=fence,
            is_stored=lambda: self.repository.is_stored(thread_id=prepared.thread_id, response_id=prepared.response_id),
            not_stored=not_stored,
            store="the thread store",
            log_id=prepared.thread_id,
        )

    async def _fence(self, prepared: PreparedTurn) -> str | None:
        """After a continue's commit failed on its way: make sure a commit still on its way changes nothing, so that
        whether the turn was stored can be read. A leased turn gives its lease back. A claimed commit may also land by
        a compare-and-set on its head with no lease live, so giving back fences nothing: the fence is the database's
        lease under a token of its own, taken on that head (after the turn's own lease, if it took one); returned, to
        be given back once read. None to take: the head moved on. Raises the database's errors."""
        claim = prepared.claim
        if claim is None or claim.leased:
            await self.leased_log.release(THREADS, prepared.thread_id, prepared.lease_token)
        if claim is None:
            return None
        now = self.clock()
        fence = new_lease_token()
        taken = await self._lease(prepared.thread_id, owner=prepared.owner, head=claim.head, token=fence, now=now)
        return fence if taken is not None else None

    async def give_back(
        self, thread_id: str, token: str, *, claim: HeadClaim | None = None, lease: bool | None = None
    ) -> None:
        """Free what `token` holds, quietly: the claim, and the database's lease (`lease`, or as `claim` says)."""
        if claim is not None and self.claims is not None:
            try:
                await self.claims.release(thread_id, claim.name, token)
            except CLAIM_FAULTS as exc:
                log.warning("could not release a claim", extra={"thread_id": thread_id, "error": type(exc).__name__})
        if not (lease if lease is not None else claim is None or claim.leased):
            return
        try:
            await self.leased_log.release(THREADS, thread_id, token)
        except DATABASE_ERRORS as exc:
            log.warning("could not release a lease", extra={"thread_id": thread_id, "error": type(exc).__name__})


def fixed_row(thread: NewThread) -> LeasedThread:
    """A new thread's fixed fields, the part of its row a commit does not return (store/thread_claims.py)."""
    return LeasedThread(
        id=thread.id,
        session_id=thread.session_id,
        system=thread.system,
        tools=thread.tools,
        system_fp=thread.system_fp,
        tools_fp=thread.tools_fp,
        output_config_fp=thread.output_config_fp,
        fixed_markers=thread.fixed_markers,
        head_position=0,
        byte_count=0,
        ttl_seconds=thread.ttl_seconds,
        owner=thread.owner,
        tenant_id=thread.tenant_id,
        metadata_user_id=thread.metadata_user_id,
    )
