"""A Responses turn apart from HTTP: prepare (owner, policy, context, lease), then commit the completed reply, or
give the conversation back. Nothing is stored before `commit`."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from statestore.auth import Principal
from statestore.clock import Clock
from statestore.core import windows as windows_of_backend
from statestore.core.lease_keeper import LeaseKeeper
from statestore.core.leased_log import CONVERSATIONS, LeasedLog
from statestore.core.lost_commit import settle_lost_commit
from statestore.core.policy_enforcement import PolicyRefusal, TurnMeasures, enforce
from statestore.core.windows import Windows
from statestore.metrics import Metrics, ResponseTurnKind, ThreadTurnOutcome
from statestore.policy import Policy
from statestore.responses.backend import backend_headers
from statestore.responses.compaction import stored_inputs
from statestore.responses.compaction_seal import CompactionSeal
from statestore.responses.context import (
    cache_key,
    chain_context,
    conversation_cache_key,
    conversation_context,
    remember_conversation,
    remember_head,
    window_for,
)
from statestore.responses.errors import (
    BadRequest,
    conversation_locked,
    conversation_not_found,
    policy_error,
    previous_response_not_found,
)
from statestore.responses.ids import looks_like, new_id
from statestore.responses.items import join_rendered, stored
from statestore.responses.kept import KeptResponse
from statestore.responses.prepared import PreparedResponse
from statestore.responses.request import TurnRequest
from statestore.responses.response_object import response_object
from statestore.store.cache import HistoryCache
from statestore.store.cache_entry import BRANCH_POINT, CachedHistory
from statestore.store.conversation_store import ConversationStore, Locked
from statestore.store.engine import DATABASE_ERRORS, UNSTORABLE_VALUE_ERRORS
from statestore.store.response_heads import ResponseHeads, cached_chain, encode_head
from statestore.store.response_records import NewResponse, ResponseRow
from statestore.store.response_store import ResponseStore
from statestore.store.sealed_cache import CONSOLIDATE_FRAMES
from statestore.store.thread_claims import CLAIM_FAULTS
from statestore.threads.ids import new_lease_token
from statestore.threads.policy_store import PolicyStore
from statestore.upstream.token_counts import ChatTokenizer


def turn_kind(turn: TurnRequest) -> ResponseTurnKind:
    if turn.previous_response_id is not None:
        return "continue"
    return "conversation" if turn.conversation_id is not None else "create"


def enforced(policy: Policy, measures: TurnMeasures) -> int:
    """`enforce` for a Responses turn: the TTL it gets, or the refusal in OpenAI's shape."""
    try:
        return enforce(policy, measures)
    except PolicyRefusal as refusal:
        raise policy_error(refusal) from None


class ResponseTurns:
    def __init__(
        self,
        *,
        leased_log: LeasedLog,
        responses: ResponseStore,
        conversations: ConversationStore,
        cache: HistoryCache,
        policies: PolicyStore,
        clock: Clock,
        lease_seconds: int,
        metrics: Metrics,
        windows: Windows | None = None,
        seal: CompactionSeal | None = None,
        heads: ResponseHeads | None = None,
        tokenizer: ChatTokenizer | None = None,
    ) -> None:
        self.metrics = metrics
        # The backend's own tokenizer, for `POST /v1/responses/input_tokens`; None: counts are estimated.
        self.tokenizer = tokenizer
        # Chain heads' rows kept beside their cached contexts (store/response_heads.py); None: read from the database.
        self.heads = heads
        self.seal = seal  # seals and opens compaction items; None: compaction is unavailable (compaction_seal.py)
        self.windows = windows  # what the backend states of its windows, for a policy's `auto` (docs/protocol.md §9)
        # A conversation's lease and every turn's commit (core/leased_log.py), shared with the Messages door.
        self.leased_log = leased_log
        self.responses = responses
        self.conversations = conversations
        self.cache = cache
        self.policies = policies
        self.clock = clock
        self.lease_ms = lease_seconds * 1000

    async def policy(self, principal: Principal, *, storing: bool) -> Policy:
        policy = await self.policies.for_tenant(principal.tenant_id)
        enforced(policy, TurnMeasures(stores=storing))
        return policy

    async def prepare(
        self,
        turn: TurnRequest,
        principal: Principal,
        ttl_header: bytes | None,
        *,
        headers: list[tuple[bytes, bytes]],
        response_id: str | None = None,
        created_at: int | None = None,
        kept: KeptResponse | None = None,
        held: KeptResponse | None = None,
    ) -> PreparedResponse:
        """Check the turn and take what it needs (a conversation's lease). `response_id` and `created_at`: a
        background turn's, run again as it was admitted. `kept`: a WebSocket connection's response kept in memory
        (responses/kept.py), which `previous_response_id` may name instead of a stored one. `held`: the stored head of
        the chain that connection made last, with its context: a continue from it reads only that Redis still serves
        it (ResponseHeads.read_held), and the database or the whole entry as any other continue when not."""
        try:
            return await self._prepare(
                turn,
                principal,
                ttl_header,
                headers=headers,
                response_id=response_id,
                created_at=created_at,
                kept=kept,
                held=held,
            )
        except Exception:
            if turn.store:
                self.metrics.count_response_turn(turn_kind(turn), "rejected")
            raise

    async def _refuse(self, prepared: PreparedResponse) -> None:
        """Give back what `prepare` took before it refused the turn (counted as rejected, not as not stored)."""
        prepared.outcome = "rejected"
        await self.give_back(prepared)

    async def _with_window(
        self, policy: Policy, turn: TurnRequest, principal: Principal, headers: list[tuple[bytes, bytes]]
    ) -> Policy:
        """The policy with its `auto` window resolved (core/windows.py), asked with the credential the turn goes out
        with (the deployment's in keys mode, the client's own in passthrough mode, as on the Messages door); only a
        turn that manages its context (`truncation: "auto"`) asks."""
        if turn.truncation != "auto":
            return policy
        return await windows_of_backend.resolved(
            self.windows, policy, turn.model, lambda: backend_headers(headers, principal)
        )

    async def _prepare(
        self,
        turn: TurnRequest,
        principal: Principal,
        ttl_header: bytes | None,
        *,
        headers: list[tuple[bytes, bytes]],
        response_id: str | None,
        created_at: int | None,
        kept: KeptResponse | None = None,
        held: KeptResponse | None = None,
    ) -> PreparedResponse:
        policy = await self._with_window(await self.policy(principal, storing=turn.store), turn, principal, headers)
        now = self.clock()
        prepared = PreparedResponse(
            turn=turn,
            principal=principal,
            response_id=response_id or new_id("resp_"),
            created_at=created_at or int(time.time()),
            ttl_ms=enforced(policy, TurnMeasures(stores=turn.store, requested_ttl=ttl_header)) * 1000,
            parent=None,
            context=b"",
            inputs=stored_inputs(turn.input, self.seal, principal.owner),
            policy=policy,
            window=window_for(policy, turn.truncation, on_conversation=turn.conversation_id is not None),
        )
        if kept is not None and turn.previous_response_id == kept.row.id:
            if turn.store:
                raise BadRequest(
                    "A stored response cannot continue one made with store: false: that one lives only in this "
                    "connection's memory.",
                    param="store",
                    code="invalid_value",
                )
            prepared.parent = kept.row
            prepared.measured = (kept.row.context_tokens, kept.row.context_bytes)
            prepared.context = kept.context
        elif turn.previous_response_id is not None:
            await self._read_chain(prepared, turn.previous_response_id, now, held=held)
        elif turn.conversation_id is not None:
            conversation = turn.conversation_id
            if not looks_like("conv_", conversation):
                raise conversation_not_found(conversation)
            token = new_lease_token()
            # The cached context is read while the lease is taken: its position is checked against the lease's after.
            reading = asyncio.ensure_future(self.cache.get(conversation_cache_key(conversation)))
            try:
                taken = await self.leased_log.take_conversation(
                    owner=principal.owner,
                    conversation_id=conversation,
                    token=token,
                    now_ms=now,
                    until_ms=now + self.lease_ms,
                )
                if taken is None:
                    raise await self.conversations.refusal(principal.owner, conversation, now)
            except BaseException as exc:
                reading.cancel()
                if isinstance(exc, Locked):
                    raise conversation_locked() from None
                if isinstance(exc, LookupError):
                    raise conversation_not_found(conversation) from None
                raise
            position, *measured = taken
            cached = await reading
            prepared.lease = token
            prepared.position = position
            prepared.measured = (measured[0], measured[1])
            prepared.cache_hit = cached is not None and cached.count == position
            prepared.cache_frames = cached.frames if cached is not None else 0
            # A reply that outlasts a third of the lease renews it, as a threaded turn does.
            prepared.keeper = LeaseKeeper(
                lambda: self.leased_log.renew(
                    CONVERSATIONS, conversation, token, until_ms=self.clock() + self.lease_ms
                ),
                interval=self.lease_ms / 3000,
                thread_id=conversation,
            )
            prepared.keeper.start()
            try:
                prepared.context = await conversation_context(
                    self.conversations, principal.owner, conversation, position=position, cached=cached
                )
            except BaseException:
                await self._refuse(prepared)
                raise
        segment = sum(len(i.rendered) for i in prepared.inputs)
        chain = prepared.parent.chain_bytes if prepared.parent else len(prepared.context)
        if turn.store:
            measures = TurnMeasures(messages=prepared.messages_sent(policy.max_messages), size=chain + segment)
            try:
                enforce(policy, measures)
            except PolicyRefusal as refusal:
                await self._refuse(prepared)
                raise policy_error(refusal) from None
        return prepared

    async def _read_chain(
        self,
        prepared: PreparedResponse,
        previous: str,
        now: int,
        *,
        turn: bool = True,
        held: KeptResponse | None = None,
    ) -> None:
        """The chain `prepared` continues, ending at `previous`: its row, measured size and context. `turn`: False for
        a count, which the metrics of turns leave out. `held`: see `prepare`."""
        if not looks_like("resp_", previous):
            raise previous_response_not_found(previous)
        parent, cached = await self._parent(previous, prepared.principal.owner, now, turn=turn, held=held)
        if parent is None:
            raise previous_response_not_found(previous)
        prepared.parent = parent
        prepared.measured = (parent.context_tokens, parent.context_bytes)
        cached = cached_chain(parent, cached)
        prepared.cache_hit = cached is not None
        prepared.cache_frames = cached.frames if cached is not None else 0
        prepared.branch_point = cached is not None and cached.version == BRANCH_POINT
        prepared.context = await chain_context(self.responses, parent, cached)

    async def prepare_count(
        self, turn: TurnRequest, principal: Principal, headers: list[tuple[bytes, bytes]]
    ) -> PreparedResponse:
        """What `turn` would send, read without taking anything (no conversation's lease, nothing counted in the
        metrics, nothing stored): for `POST /v1/responses/input_tokens`. Refused as the turn would be: an unknown
        previous response (400), conversation (404), one over the policy's bounds (400)."""
        policy = await self._with_window(await self.policy(principal, storing=False), turn, principal, headers)
        prepared = PreparedResponse(
            turn=turn,
            principal=principal,
            response_id="",
            created_at=0,
            ttl_ms=0,
            parent=None,
            context=b"",
            inputs=stored_inputs(turn.input, self.seal, principal.owner),
            policy=policy,
            window=window_for(policy, turn.truncation, on_conversation=turn.conversation_id is not None),
        )
        now = self.clock()
        if turn.previous_response_id is not None:
            await self._read_chain(prepared, turn.previous_response_id, now, turn=False)
        elif turn.conversation_id is not None:
            conversation = turn.conversation_id
            state = (
                await self.conversations.context_state(principal.owner, conversation, now_ms=now)
                if looks_like("conv_", conversation)
                else None
            )
            if state is None:
                raise conversation_not_found(conversation)
            position, tokens, counted = state
            prepared.measured = (tokens, counted)
            cached = await self.cache.get(conversation_cache_key(conversation))
            prepared.context = await conversation_context(
                self.conversations, principal.owner, conversation, position=position, cached=cached
            )
        # Refused over the policy's bounds as the stored turn it counts would be (a count has no `store`: the turn's
        # default, stored), as a count over a thread is; the count itself stores nothing.
        chain = prepared.parent.chain_bytes if prepared.parent else len(prepared.context)
        size = chain + sum(len(i.rendered) for i in prepared.inputs)
        enforced(policy, TurnMeasures(stores=False, messages=prepared.messages_sent(policy.max_messages), size=size))
        return prepared

    async def _parent(
        self, previous: str, owner: str, now: int, *, turn: bool = True, held: KeptResponse | None = None
    ) -> tuple[ResponseRow | None, CachedHistory | None]:
        """The previous response's row and the chain's cached context: the row kept beside that context when there is
        one to serve (store/response_heads.py), else the database's, with the context read beside it."""
        if self.heads is not None:
            try:
                head = None
                if held is not None and held.row.id == previous:
                    head = await self.heads.read_held(previous, held.context, owner=owner, now_ms=now)
                if head is None or head.row is None:
                    head = await self.heads.read(previous, owner=owner, now_ms=now)
            except CLAIM_FAULTS:
                head = None  # Redis away: the database's row, and the cache read as before
            if turn:
                self.metrics.count_response_parent("cache" if head is not None and head.row is not None else "database")
            if head is not None:
                return head.row or await self.responses.get(owner, previous, now_ms=now), head.cached
        # The cached context is read beside the response, and taken when it is the row's context now (cached_chain).
        # One task for the read; the response's in this one (gather would wrap both), as a threaded turn does.
        reading = asyncio.ensure_future(self.cache.get(cache_key(previous)))
        try:
            parent = await self.responses.get(owner, previous, now_ms=now)
        except BaseException:
            reading.cancel()
            raise
        return parent, await reading

    def response(
        self,
        prepared: PreparedResponse,
        *,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None,
        incomplete: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return response_object(
            prepared.response_id,
            prepared.turn,
            created_at=prepared.created_at,
            status=status,
            output=output,
            usage=usage,
            incomplete_details=incomplete,
        )

    async def commit(self, prepared: PreparedResponse, response: dict[str, Any], body: bytes) -> bool:
        """Store the completed turn (store: true), appending to its conversation. False when it could not be.
        `body`: the response's JSON, encoded once by the caller for the store and the client."""
        turn = prepared.turn
        if not turn.store:
            await self.give_back(prepared)
            return True
        outputs = [stored(item) for item in response["output"]]
        segment = join_rendered((i.kind, i.rendered) for i in [*prepared.inputs, *outputs])
        now = self.clock()
        new = NewResponse(
            id=prepared.response_id,
            owner=prepared.principal.owner,
            tenant_id=prepared.principal.tenant_id,
            metadata_user_id=turn.metadata.get("user_id"),
            parent=prepared.parent,
            conversation_id=turn.conversation_id,
            segment_bytes=len(segment),
            body=body,
            created_ms=now,
            expires_ms=now + prepared.ttl_ms,
            inputs=prepared.inputs,
            outputs=outputs,
            conversation_position=prepared.position if turn.conversation_id is not None else None,
            context=prepared.context_record(
                prepared.response_id,
                response.get("usage"),
                segment=segment,
                reply_bytes=len(join_rendered((i.kind, i.rendered) for i in outputs)),
            ),
        )
        self._stop_keeper(prepared)
        try:
            committed = await self.leased_log.commit_response(new, prepared.lease)
        except UNSTORABLE_VALUE_ERRORS:
            raise  # the request's fault (a 400), refused by the statement: nothing was stored
        except DATABASE_ERRORS as exc:
            await self._settle(prepared, exc)
            # Stored: answered as stored. Its cache entries are left unwritten; the next turn reads the database.
            return True
        prepared.done = True
        self._count(prepared, "stored" if committed is not None else "not_stored")
        if committed is None:
            return False
        # The cache entry is sealed under the turn's scope as its rows are (the keys remember it: no second lookup).
        sealer = await self.responses.sealer_for(new)
        if turn.conversation_id is not None:
            await remember_conversation(
                self.cache,
                turn.conversation_id,
                leased_at=prepared.position,
                # Exactly where the commit left it: while the lease was held nothing else could move the position
                # (an append or a deletion takes only a free lease over, and clears it, so the commit then fails).
                position=prepared.position + len(new.inputs) + len(new.outputs),
                hit=prepared.cache_hit,
                context=prepared.context,
                added=[*prepared.inputs, *outputs],
                segment=segment,
                ttl_ms=prepared.ttl_ms,
                sealer=sealer,
                whole=prepared.cache_frames > CONSOLIDATE_FRAMES,
            )
        else:
            depth = prepared.parent.depth + 1 if prepared.parent else 0
            await remember_head(
                self.cache,
                response_id=prepared.response_id,
                depth=depth,
                context=prepared.context,
                segment=segment,
                parent_id=prepared.parent.id if prepared.parent else None,
                hit=prepared.cache_hit,
                ttl_ms=prepared.ttl_ms,
                sealer=sealer,
                whole=prepared.cache_frames > CONSOLIDATE_FRAMES,
                conversation_version=prepared.parent.conversation_version if prepared.parent else None,
                branched=prepared.branch_point,
                row=encode_head(committed) if self.heads is not None else None,
                parent_row=prepared.parent if self.heads is not None else None,
            )
            if self.heads is not None:
                prepared.stored = (committed, segment)
        return True

    async def _settle(self, prepared: PreparedResponse, error: BaseException) -> None:
        """The commit's answer was lost: settled as on every door (core/lost_commit.py), so that a retry never stores
        the turn twice. A conversation's fence is its lease given back, which a commit still on its way needs; a
        chain's, its response id waited out (ResponseStore.is_stored). Returns when the turn was stored; raises
        ServiceUnavailable otherwise."""
        conversation, lease = prepared.turn.conversation_id, prepared.lease

        async def fence() -> None:
            prepared.done = True  # whatever the settling finds, there is nothing left to give back
            if conversation is not None and lease is not None:
                await self.leased_log.release(CONVERSATIONS, conversation, lease)

        async def not_stored(_: None) -> None:
            self._count(prepared, "not_stored")

        log_id = conversation or (prepared.parent.root_id if prepared.parent else prepared.response_id)
        await settle_lost_commit(
            error,
            fence=fence,
            is_stored=lambda: self.responses.is_stored(prepared.response_id),
            not_stored=not_stored,
            store="the response store",
            log_id=log_id,
        )
        self._count(prepared, "stored")

    @staticmethod
    def _stop_keeper(prepared: PreparedResponse) -> None:
        if prepared.keeper is not None:
            prepared.keeper.stop()
            prepared.keeper = None

    def _count(self, prepared: PreparedResponse, outcome: ThreadTurnOutcome) -> None:
        """Count a turn that asked to be stored (store: false is a relay, as a request without a thread is), once."""
        if prepared.turn.store and prepared.outcome is None:
            prepared.outcome = outcome
            self.metrics.count_response_turn(turn_kind(prepared.turn), outcome)

    async def hand_over(self, prepared: PreparedResponse) -> None:
        """A background turn admitted for another replica to run: what `prepare` took is given back, and the turn is
        counted by the run that stores it, not here."""
        prepared.outcome = prepared.outcome or "not_stored"
        await self.give_back(prepared)

    async def give_back(self, prepared: PreparedResponse) -> None:
        """The turn ends without a commit: its conversation is free again. Safe to call after a commit."""
        self._stop_keeper(prepared)
        self._count(prepared, "not_stored")
        if prepared.lease is not None and not prepared.done and prepared.turn.conversation_id is not None:
            prepared.done = True
            await self.leased_log.release(CONVERSATIONS, prepared.turn.conversation_id, prepared.lease)
