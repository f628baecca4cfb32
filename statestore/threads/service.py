"""The threaded turn as a state machine (docs/protocol.md §2 to §6): `begin` takes the thread head (a lease) and
rebuilds the request; then exactly one of `commit` (the reply completed: append the turn, move the head) or `give_back`
(nothing is stored; the same id stays continuable). Domain objects in and out: the HTTP face (api/threaded.py) forwards
the request and relays the reply."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Literal

import anyio
import orjson

from statestore.auth import Principal
from statestore.clock import wall_clock_ms
from statestore.content_keys import CLEAR, ContentKeys, ContentSealer
from statestore.core.leased_log import LeasedLog
from statestore.core.windows import Windows
from statestore.errors import (
    InvalidRequest,
    ServiceUnavailable,
    StatestoreError,
    ThreadContinueInFlight,
    ThreadNotFound,
)
from statestore.metrics import Metrics
from statestore.policy import Policy
from statestore.store.cache import HistoryCache
from statestore.store.cache_entry import thread_key
from statestore.store.engine import DATABASE_ERRORS, UNSTORABLE_VALUE_ERRORS
from statestore.store.thread_claims import HeadClaims, Settle, encode_row
from statestore.store.thread_sealing import thread_scope
from statestore.store.thread_store import ThreadStore
from statestore.store.turn_records import HeadAfter, NewThread, TurnCommit
from statestore.threads import assembly, context_cache, context_step, rules
from statestore.threads.diagnostics import minted_previous_id, rewrite_previous_id
from statestore.threads.head_holds import HeadHolds, Held, fixed_row
from statestore.threads.ids import new_lease_token, new_response_id, new_thread_id, thread_of_response
from statestore.threads.policy_store import PolicyStore
from statestore.threads.prepared import CompletedReply, PreparedTurn, Recut, replay_fields
from statestore.threads.refusal_retry import with_window
from statestore.threads.summary import Summaries, summarizer
from statestore.threads.turn import ThreadTurn
from statestore.upstream.token_counts import MessagesCounter

log = logging.getLogger(__name__)


class ThreadService:
    def __init__(
        self,
        *,
        leased_log: LeasedLog,
        repository: ThreadStore,
        cache: HistoryCache,
        policies: PolicyStore,
        lease_seconds: int,
        metrics: Metrics,
        summaries: Summaries | None = None,
        windows: Windows | None = None,
        clock: Callable[[], int] = wall_clock_ms,
        content: ContentKeys | None = None,
        claims: HeadClaims | None = None,
        counter: MessagesCounter | None = None,
    ) -> None:
        """`leased_log`: where a turn takes, renews, releases its thread's lease and commits (core/leased_log.py), the
        log the Responses door's conversations share; `repository`: the statements only a thread has beside it.
        `summaries`: where a `summarize` policy's summary requests go (docs/protocol.md §9); without it, such a
        policy truncates. `windows`: what the backend states of its windows, for a policy whose window is `auto`.
        `content`: the keys the cache entries are sealed with (the repository seals the rows); None or not enabled
        when encryption is off. `claims`: a continue by response id claims the head in Redis (store/thread_claims.py);
        None, every turn leases it in the database. `counter`: the backend's `count_tokens`, for a count over a thread
        (threads/count.py); None, such counts are estimated."""
        self._content = content if content is not None and content.enabled else None
        self.claims = claims
        self.metrics = metrics
        self.windows = windows
        self.counter = counter
        self.summaries = summaries
        self.repository = repository
        self.cache = cache
        self.policies = policies
        self.lease_ms = lease_seconds * 1000
        self.clock = clock
        self.leased_log = leased_log
        self.heads = HeadHolds(
            leased_log=leased_log,
            repository=repository,
            cache=cache,
            claims=claims,
            metrics=metrics,
            lease_ms=self.lease_ms,
            clock=clock,
        )

    async def begin(
        self,
        turn: ThreadTurn,
        principal: Principal,
        headers: Iterable[tuple[bytes, bytes]] = (),
        *,
        response_id: str | None = None,
    ) -> PreparedTurn:
        """Take the head of the turn's thread (or start a new one) and rebuild the request to forward. `headers`: the
        client's, which a summary request carries as the turn does. `response_id`: the reply's id an Idempotency-Key's
        claim named (api/threaded_keyed.py), kept when it is of the thread the turn takes (a create's thread is the
        one it names); else a new one is minted. Raises a StatestoreError (a thread error, 400, 503) with nothing held
        when the turn cannot go ahead."""
        kind: Literal["create", "continue"] = "continue" if turn.mode == "continue" else "create"
        try:
            policy = await with_window(
                self.windows, await self.policies.for_tenant(principal.tenant_id), turn, headers, principal
            )
            rules.check_policy(policy, turn)
            prepared = await self._prepare(
                turn,
                principal,
                policy,
                summarizer(self.summaries, headers, principal.upstream_credential),
                response_id,
            )
        except StatestoreError:
            self.metrics.count_thread_turn(kind, "rejected")
            raise
        except orjson.JSONEncodeError as exc:
            # orjson writes at most 254 levels of nesting, though it reads more.
            self.metrics.count_thread_turn(kind, "rejected")
            raise InvalidRequest(
                "the request cannot be stored: nested too deeply or holds an unsupported value"
            ) from exc
        except UNSTORABLE_VALUE_ERRORS as exc:
            self.metrics.count_thread_turn(kind, "rejected")
            raise InvalidRequest("the request holds a value the thread store cannot keep") from exc
        except DATABASE_ERRORS as exc:
            self.metrics.count_thread_turn(kind, "rejected")
            log.warning("database unavailable for a threaded turn", extra={"error": type(exc).__name__})
            raise ServiceUnavailable("the thread store is unavailable; try again shortly") from exc
        return prepared

    # -- taking the head ---------------------------------------------------------------------------------------

    async def _prepare(
        self,
        turn: ThreadTurn,
        principal: Principal,
        policy: Policy,
        summarize: context_step.Summarize | None,
        response_id: str | None,
    ) -> PreparedTurn:
        owner = principal.owner
        now = self.clock()
        token = new_lease_token()
        if minted_previous_id(turn.fields) is not None:
            await rewrite_previous_id(turn.fields, owner=owner, store=self.repository, now_ms=now)
        if turn.mode == "continue":
            assert turn.previous_message_id is not None
            thread_id = thread_of_response(turn.previous_message_id)
            if thread_id is None:
                raise ThreadNotFound("no thread has a response with this id")
            held = await self.heads.take_by_response(
                thread_id=thread_id, owner=owner, response_id=turn.previous_message_id, token=token, now=now
            )
            return await self._continue(held, token, turn, policy, now, summarize=summarize, response_id=response_id)
        if turn.mode == "session":
            assert turn.session is not None
            leased = await self.leased_log.take_session(
                owner=owner, session=turn.session, token=token, now_ms=now, until_ms=now + self.lease_ms
            )
            if leased is not None:
                self.metrics.count_thread_head("lease")
                held = Held(leased=leased, cached=None, claim=None)
                return await self._continue(
                    held, token, turn, policy, now, summarize=summarize, prefetched=False, response_id=response_id
                )
            if await self.repository.session_is_busy(owner=owner, session=turn.session, now_ms=now):
                raise ThreadContinueInFlight("another request is continuing this session right now")
        return await self._create(principal, token, turn, policy, now, response_id=response_id)

    async def _sealer(self, owner: str, tenant_id: str | None, user_id: str | None) -> ContentSealer:
        """The sealer of a thread's scope; CLEAR (and no await that does work) when encryption is off."""
        if self._content is None:
            return CLEAR
        return await self._content.sealer(thread_scope(owner, tenant_id, user_id))

    async def _create(
        self, principal: Principal, token: str, turn: ThreadTurn, policy: Policy, now: int, *, response_id: str | None
    ) -> PreparedTurn:
        system = turn.system if turn.has_system else None
        tools = turn.tools if turn.has_tools else None
        fixed_markers = assembly.count_cache_markers(system) + assembly.count_tool_markers(tools)
        new = assembly.encode_new_messages(turn.messages)
        rules.check_markers(fixed_markers + new.markers)
        system_bytes = assembly.encode(system) if turn.has_system else None
        tools_bytes = assembly.encode(tools) if turn.has_tools else None
        fixed_bytes = len(system_bytes or b"") + len(tools_bytes or b"")
        ttl = rules.check_limits(
            policy,
            messages=len(new.stored) + 1,
            size=fixed_bytes + sum(map(len, new.stored)),
            ttl_header=turn.ttl_header,
            current_ttl=None,
        )
        named = thread_of_response(response_id) if response_id is not None else None
        if named is None:
            response_id = None
        thread = NewThread(
            id=named or new_thread_id(),
            owner=principal.owner,
            tenant_id=principal.tenant_id,
            session_id=turn.session,
            metadata_user_id=turn.metadata_user_id,
            system=system_bytes,
            tools=tools_bytes,
            system_fp=assembly.fingerprint(system),
            tools_fp=assembly.fingerprint(tools),
            output_config_fp=assembly.fingerprint(turn.fields.get("output_config")),
            fixed_markers=fixed_markers,
            ttl_seconds=ttl,
        )
        # A `thread` field wins over the session header: an explicit create takes the name even from a live thread,
        # but only once its reply commits, so a create that fails leaves the name where it was (docs/protocol.md §6).
        explicit = turn.mode == "create"
        # Built before anything is written, so a body that cannot be encoded leaves no row behind.
        body = assembly.build_body(
            turn.fields, system=system_bytes, tools=tools_bytes, history=b"", new_messages=new.forwarded
        )
        sealer = await self._sealer(principal.owner, principal.tenant_id, turn.metadata_user_id)
        if not await self.repository.begin_create(
            thread, token=token, now_ms=now, lease_until_ms=now + self.lease_ms, bind_session=not explicit
        ):
            raise ThreadContinueInFlight("another request is continuing this session right now")
        return PreparedTurn(
            thread_id=thread.id,
            lease_token=token,
            keeper=self.heads.keep(thread.id, token),
            creating=True,
            start_position=0,
            new_rows=new.stored,
            response_id=response_id or new_response_id(thread.id),
            ttl_seconds=ttl,
            expires_ms=now + ttl * 1000,
            session=turn.session,
            metadata_user_id=turn.metadata_user_id,
            upstream_body=body,
            history_count=0,
            anthropic_beta=turn.anthropic_beta,
            stream=turn.stream,
            fixed_bytes=fixed_bytes,
            rebind_session=(principal.owner, turn.session) if explicit and turn.session is not None else None,
            replay=replay_fields(turn),
            owner=principal.owner,
            sealer=sealer,
            row=fixed_row(thread) if self.claims is not None else None,
            scope_user_id=turn.metadata_user_id,
        )

    async def _continue(
        self,
        held: Held,
        token: str,
        turn: ThreadTurn,
        policy: Policy,
        now: int,
        *,
        summarize: context_step.Summarize | None,
        prefetched: bool = True,
        response_id: str | None = None,
    ) -> PreparedTurn:
        """`held`: the thread, and the Redis claim on its head if any (without the database's lease, its commit is a
        compare-and-set on that head); `prefetched`: whether `held.cached` was read."""
        leased, cached, claim = held.leased, held.cached, held.claim
        # Kept from the moment it is taken: a summary (§9) is a whole backend call before the turn's own, and may
        # outlast the lease.
        keeper = self.heads.keep(leased.id, token, claim=claim, owner=leased.owner)
        try:
            rules.check_fixed_fields(leased, turn)
            new = assembly.encode_new_messages(turn.messages)
            rules.check_markers(leased.fixed_markers + new.markers)
            fixed_bytes = len(leased.system or b"") + len(leased.tools or b"")
            moved = None
            if policy.context_strategy != "none":  # only a managed context costs anything, past its trigger (§9)
                moved = await context_step.step(
                    self.repository, leased, turn, policy, new.forwarded, summarize=summarize
                )
            # Limits count what the rebuild sends, not the archive.
            ttl = rules.check_limits(
                policy,
                messages=(moved.messages if moved else leased.context_messages) + len(new.stored) + 1,
                size=fixed_bytes + (moved.size if moved else leased.context_bytes) + sum(map(len, new.stored)),
                ttl_header=turn.ttl_header,
                current_ttl=leased.ttl_seconds,
            )
            # The row keeps the first user id a turn gave (COALESCE): this turn's rows go under the scope it will hold.
            scope_user = leased.metadata_user_id or turn.metadata_user_id
            sealer = await self._sealer(leased.owner, leased.tenant_id, scope_user)
            cache_frames = 0
            if moved is not None:
                history = moved.joined
            else:
                if not prefetched:
                    cached = await self.cache.get(thread_key(leased.id))
                history = await context_cache.context_of(
                    self.cache, self.repository, self.metrics, leased, cached, ttl_ms=ttl * 1000, sealer=sealer
                )
                if cached is not None and cached.count == leased.head_position:
                    cache_frames = cached.frames
            body = assembly.build_body(
                turn.fields, system=leased.system, tools=leased.tools, history=history, new_messages=new.forwarded
            )
        except BaseException:
            keeper.stop()
            with anyio.CancelScope(shield=True):
                await self.heads.give_back(leased.id, token, claim=claim)
            raise
        return PreparedTurn(
            thread_id=leased.id,
            lease_token=token,
            keeper=keeper,
            creating=False,
            start_position=leased.head_position,
            new_rows=new.stored,
            response_id=(
                response_id
                if response_id is not None and thread_of_response(response_id) == leased.id
                else new_response_id(leased.id)
            ),
            ttl_seconds=ttl,
            expires_ms=now + ttl * 1000,
            session=turn.session,
            metadata_user_id=turn.metadata_user_id,
            upstream_body=body,
            history_count=leased.head_position,
            anthropic_beta=turn.anthropic_beta,
            stream=turn.stream,
            archive_bytes=leased.byte_count,
            fixed_bytes=fixed_bytes,
            moved=moved,
            replay=replay_fields(turn),
            recut=Recut(leased, turn, policy, new.forwarded, summarize) if policy.context_strategy != "none" else None,
            owner=leased.owner,
            sealer=sealer,
            history=history,
            cache_frames=cache_frames,
            claim=claim,
            row=leased if self.claims is not None else None,
            scope_user_id=scope_user,
        )

    # -- settling the turn -------------------------------------------------------------------------------------

    async def commit(self, prepared: PreparedTurn, reply: CompletedReply) -> None:
        """Store the turn and move the head. Raises ServiceUnavailable (database) or ThreadContinueInFlight (the
        lease ran out and another request took the head); the turn is then not stored."""
        prepared.stop_keeper()
        rows: list[tuple[bytes, str | None]] = [(body, None) for body in prepared.new_rows]
        rows.append((reply.row, prepared.response_id))
        now = self.clock()
        move, context_tokens = context_step.after_reply(
            prepared.moved.move if prepared.moved is not None else None,
            reply.usage,
            compaction=reply.compaction,
            sent_bytes=len(prepared.upstream_body) + len(reply.row),
            fixed_bytes=prepared.fixed_bytes,
            reply_position=prepared.start_position + len(rows),
            archive_bytes=prepared.archive_bytes + sum(len(body) for body, _ in rows),
        )
        prepared.compacted = reply.compaction is not None
        # The TTL runs from the stored reply (§5), however long the backend took; a stream's header, sent before
        # the reply, promised no later than this.
        prepared.expires_ms = now + prepared.ttl_seconds * 1000
        commit = TurnCommit(
            thread_id=prepared.thread_id,
            lease_token=prepared.lease_token,
            start_position=prepared.start_position,
            rows=rows,
            head_message_id=prepared.response_id,
            expires_ms=prepared.expires_ms,
            ttl_seconds=prepared.ttl_seconds,
            now_ms=now,
            metadata_user_id=prepared.metadata_user_id,
            rebind_session=prepared.rebind_session,
            reply_backend_id=reply.backend_id,
            usage=reply.usage,
            model=prepared.replay[0],
            max_tokens=prepared.replay[1],
            context_tokens=context_tokens,
            move=move,
            owner=prepared.owner,
            sealer=prepared.sealer,
            expected_head=prepared.expected_head,
        )
        committed: HeadAfter | bool
        try:
            committed = await self.leased_log.commit_thread_turn(commit)
        except DATABASE_ERRORS as exc:
            log.warning("could not commit a turn", extra={"thread_id": prepared.thread_id, "error": type(exc).__name__})
            committed = await self.heads.settle_lost_commit(prepared, exc)
        if committed is False:
            if prepared.expected_head is not None:
                # Claimed: the head moved or a lease is live, found only now; the database says which.
                reason = await self.repository.why_not_continuable(
                    owner=prepared.owner, thread_id=prepared.thread_id, response_id=prepared.expected_head, now_ms=now
                )
                raise rules.refusal(reason)
            raise ThreadContinueInFlight("the lease on this thread ran out before the reply completed")
        prepared.outcome = "stored"
        self.metrics.count_thread_turn("create" if prepared.creating else "continue", "stored")
        then = None
        if self.claims is not None:
            # The row goes beside the history and the claim is freed, in the script that writes the history.
            row = None
            if isinstance(committed, HeadAfter) and prepared.row is not None:
                row = encode_row(prepared.row, committed, prepared.response_id)
            claimed = prepared.claim.name if prepared.claim is not None else None
            then = Settle(row=row, claimed_head=claimed, token=prepared.lease_token)
        await context_cache.after_commit(self.cache, prepared, [body for body, _ in rows], reply.compaction, then)

    async def give_back(self, prepared: PreparedTurn) -> None:
        """Store nothing and free the head (a create's row goes). Safe to call more than once, and after commit."""
        prepared.stop_keeper()
        if prepared.outcome != "open":
            return
        prepared.outcome = "given_back"
        self.metrics.count_thread_turn("create" if prepared.creating else "continue", "not_stored")
        if prepared.creating:
            try:
                await self.repository.abandon_create(thread_id=prepared.thread_id, token=prepared.lease_token)
            except DATABASE_ERRORS as exc:
                # The lease still runs out by itself; the thread stays continuable after that.
                log.warning(
                    "could not release a lease", extra={"thread_id": prepared.thread_id, "error": type(exc).__name__}
                )
            return
        await self.heads.give_back(prepared.thread_id, prepared.lease_token, claim=prepared.claim)
