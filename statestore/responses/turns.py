"""A Responses turn apart from HTTP: prepare (owner, policy, context, lease), then commit the completed reply, or
give the conversation back. Nothing is stored before `commit`."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from statestore.auth import Principal
from statestore.clock import Clock
from statestore.metrics import Metrics, ResponseTurnKind, ThreadTurnOutcome
from statestore.policy import Policy
from statestore.responses import context
from statestore.responses.backend_window import with_window
from statestore.responses.compaction import stored_inputs
from statestore.responses.compaction_seal import CompactionSeal
from statestore.responses.context import (
    Base,
    Move,
    Summarize,
    cache_key,
    cached_chain,
    chain_base,
    chain_context,
    conversation_cache_key,
    conversation_context,
    kept_after,
    remember_conversation,
    remember_head,
    window_for,
)
from statestore.responses.errors import (
    BadRequest,
    conversation_locked,
    conversation_not_found,
    previous_response_not_found,
)
from statestore.responses.ids import looks_like, new_id
from statestore.responses.items import join_rendered, stored
from statestore.responses.reply import response_object
from statestore.responses.request import TurnRequest, chat_body
from statestore.store.cache import HistoryCache
from statestore.store.conversation_store import ConversationStore, Locked
from statestore.store.response_records import ContextRecord, NewResponse, ResponseRow, StoredItem
from statestore.store.response_store import ResponseStore
from statestore.threads import planner
from statestore.threads.ids import new_lease_token
from statestore.threads.lease import LeaseKeeper
from statestore.threads.policy_store import PolicyStore
from statestore.upstream.windows import Windows


def turn_kind(turn: TurnRequest) -> ResponseTurnKind:
    if turn.previous_response_id is not None:
        return "continue"
    return "conversation" if turn.conversation_id is not None else "create"


@dataclass(slots=True)
class PreparedResponse:
    turn: TurnRequest
    principal: Principal
    response_id: str
    created_at: int
    ttl_ms: int
    parent: ResponseRow | None
    context: bytes  # the stored chain's (or conversation's) messages, untruncated
    inputs: list[StoredItem]
    policy: Policy | None = None
    window: planner.Window | None = None  # the context policy `truncation: "auto"` applies (PROTOCOL §9)
    lease: str | None = None
    position: int = 0  # on a conversation: its position when the lease was taken
    cache_hit: bool = False  # the context came from the cache (its entry can be extended in place)
    keeper: LeaseKeeper | None = None
    done: bool = field(default=False)
    moved: Move | None = None  # the context's base moved for this request (`plan_context`)
    outcome: ThreadTurnOutcome | None = None  # as counted in the metrics, once
    sent_bytes: int = 0  # the bytes of `messages` and tools the backend counts the prompt of
    # The backend's token count of the last turn (the parent's, or the conversation's) and the bytes it counted.
    measured: tuple[int, int] = (0, 0)
    compaction: dict[str, Any] | None = None  # the compaction item this turn made (`compact`), its output's first
    _base: Base | None = None

    @property
    def managed(self) -> bool:
        """This turn manages its chain's context (a policy's window with `truncation: "auto"`, or compaction): it
        starts where the parent's turn left the context, and records where the next one starts."""
        return (self.window is not None or self.turn.compaction) and self.turn.conversation_id is None

    @property
    def base(self) -> Base:
        """Where this request's context starts before any move: where the parent's turn left it, when this turn
        manages its context; else the whole chain, as "disabled" forwards it. Found once (it slices the context)."""
        if self._base is None:
            self._base = chain_base(self.parent, self.context) if self.managed else Base(self.context)
        return self._base

    def system_message(self) -> bytes:
        instructions = self.turn.instructions
        return orjson.dumps({"role": "system", "content": instructions}) if instructions is not None else b""

    def fixed_bytes(self, system: bytes) -> int:
        tools = self.turn.chat_params.get("tools")
        return len(system) + (len(orjson.dumps(tools)) if tools else 0)

    async def plan_context(
        self, summarize: Summarize | None, *, forced: planner.Window | None = None, ratio: float | None = None
    ) -> None:
        """Move the context's base when this turn passes the trigger (PROTOCOL §9): before `backend_body`. `forced`:
        the window of a turn the backend refused, cut whatever the estimate says, at the refusal's `ratio`."""
        if forced is not None:
            self.window = forced  # the base it moves to is recorded for the next turn (context_record)
        if self.window is None:
            return
        system = self.system_message()
        policy = self.policy
        ratio = ratio or planner.tokens_per_byte(*self.measured)

        def summary_request(summarised: list[bytes], budget: int) -> bytes:
            return context.summary_body(
                self.turn.chat_params,
                system,
                model=(policy.summary_model if policy else None) or self.turn.model,
                max_tokens=budget,
                summarised=summarised,
                instructions=policy.summary_instructions if policy else None,
            )

        self.moved = await context.plan(
            self.window,
            self.base,
            fixed_bytes=self.fixed_bytes(system),
            new=join_rendered((i.kind, i.rendered) for i in self.inputs),
            ratio=ratio,
            summary_request=summary_request,
            summarize=summarize,
            force=forced is not None,
        )

    def backend_body(self) -> bytes:
        system = self.system_message()
        new = join_rendered((i.kind, i.rendered) for i in self.inputs)
        base = self.moved.base if self.moved is not None else self.base
        segments = [system, base.head or b"", base.context, new]
        self.sent_bytes = self.fixed_bytes(system) + base.size + len(new)
        return chat_body(self.turn.chat_params, segments, stream=self.turn.stream)

    def context_record(
        self, response_id: str, usage: dict[str, Any] | None, *, segment: bytes, reply_bytes: int
    ) -> ContextRecord:
        """What the commit stores of this turn's context: the backend's count of it (the prompt and the reply) and
        the bytes it counted; on a chain whose context this turn managed, where the next turn's context starts."""
        total = usage.get("total_tokens") if isinstance(usage, dict) else None
        tokens = total if isinstance(total, int) and total > 0 else 0
        counted = self.sent_bytes + reply_bytes if tokens else 0
        if not self.managed:
            return ContextRecord(tokens, counted)
        base = self.moved.base if self.moved is not None else self.base
        if base.whole:
            return ContextRecord(tokens, counted)
        head_id: str | None = base.head_id
        head = None
        if self.moved is not None and self.moved.action in ("summarized", "compacted"):
            head_id, head = response_id, base.head  # stored once, here; the descendants name this response
        return ContextRecord(tokens, counted, kept_after(base, segment), head_id, head)


class ResponseTurns:
    def __init__(
        self,
        *,
        responses: ResponseStore,
        conversations: ConversationStore,
        cache: HistoryCache,
        policies: PolicyStore,
        clock: Clock,
        lease_seconds: int,
        metrics: Metrics,
        windows: Windows | None = None,
        seal: CompactionSeal | None = None,
    ) -> None:
        self.metrics = metrics
        self.seal = seal  # seals and opens compaction items; None: compaction is unavailable (compaction_seal.py)
        self.windows = windows  # what the backend states of its windows, for a policy's `auto` (PROTOCOL §9)
        self.responses = responses
        self.conversations = conversations
        self.cache = cache
        self.policies = policies
        self.clock = clock
        self.lease_ms = lease_seconds * 1000

    async def policy(self, principal: Principal, *, storing: bool) -> Policy:
        policy = await self.policies.for_tenant(principal.tenant_id)
        if storing and not policy.threads_enabled:
            raise BadRequest(
                "Storing responses is disabled by this deployment's retention policy; send store: false.",
                param="store",
                code="storage_disabled",
            )
        return policy

    async def prepare(self, turn: TurnRequest, principal: Principal, ttl_header: bytes | None) -> PreparedResponse:
        try:
            return await self._prepare(turn, principal, ttl_header)
        except Exception:
            if turn.store:
                self.metrics.count_response_turn(turn_kind(turn), "rejected")
            raise

    async def _refuse(self, prepared: PreparedResponse) -> None:
        """Give back what `prepare` took before it refused the turn (counted as rejected, not as not stored)."""
        prepared.outcome = "rejected"
        await self.give_back(prepared)

    async def _prepare(self, turn: TurnRequest, principal: Principal, ttl_header: bytes | None) -> PreparedResponse:
        policy = await with_window(self.windows, await self.policy(principal, storing=turn.store), turn, principal)
        now = self.clock()
        prepared = PreparedResponse(
            turn=turn,
            principal=principal,
            response_id=new_id("resp_"),
            created_at=int(time.time()),
            ttl_ms=policy.ttl_for(ttl_header, None) * 1000,
            parent=None,
            context=b"",
            inputs=stored_inputs(turn.input, self.seal, principal.owner),
            policy=policy,
            window=window_for(policy, turn.truncation, on_conversation=turn.conversation_id is not None),
        )
        if turn.previous_response_id is not None:
            previous = turn.previous_response_id
            if not looks_like("resp_", previous):
                raise previous_response_not_found(previous)
            # The cached context is read beside the response, and taken when it is the row's context now (cached_chain).
            # One task for the read; the response's in this one (gather would wrap both), as a threaded turn does.
            reading = asyncio.ensure_future(self.cache.get(cache_key(previous)))
            try:
                parent = await self.responses.get(principal.owner, previous, now_ms=now)
            except BaseException:
                reading.cancel()
                raise
            cached = await reading
            if parent is None:
                raise previous_response_not_found(previous)
            prepared.parent = parent
            prepared.measured = (parent.context_tokens, parent.context_bytes)
            cached = cached_chain(parent, cached)
            prepared.cache_hit = cached is not None
            prepared.context = await chain_context(self.responses, parent, cached)
        elif turn.conversation_id is not None:
            conversation = turn.conversation_id
            if not looks_like("conv_", conversation):
                raise conversation_not_found(conversation)
            token = new_lease_token()
            # The cached context is read while the lease is taken: its position is checked against the lease's after.
            reading = asyncio.ensure_future(self.cache.get(conversation_cache_key(conversation)))
            try:
                position, *measured = await self.conversations.lease(
                    principal.owner, conversation, token=token, now_ms=now, until_ms=now + self.lease_ms
                )
            except BaseException as exc:
                reading.cancel()
                if isinstance(exc, Locked):
                    raise conversation_locked() from None
                if isinstance(exc, LookupError):
                    raise conversation_not_found(conversation) from None
                raise
            cached = await reading
            prepared.lease = token
            prepared.position = position
            prepared.measured = (measured[0], measured[1])
            prepared.cache_hit = cached is not None and cached.count == position
            # A reply that outlasts a third of the lease renews it, as a threaded turn does.
            prepared.keeper = LeaseKeeper(
                lambda: self.conversations.renew(conversation, token, until_ms=self.clock() + self.lease_ms),
                interval=self.lease_ms / 3000,
                thread_id=conversation,
            )
            prepared.keeper.start()
            try:
                prepared.context = await conversation_context(
                    self.conversations, conversation, position=position, cached=cached
                )
            except BaseException:
                await self._refuse(prepared)
                raise
        segment = sum(len(i.rendered) for i in prepared.inputs)
        chain = prepared.parent.chain_bytes if prepared.parent else len(prepared.context)
        if turn.store and chain + segment > policy.max_thread_bytes:
            await self._refuse(prepared)
            raise BadRequest(
                f"The conversation would exceed this deployment's limit of {policy.max_thread_bytes} bytes.",
                param="input",
                code="context_too_large",
            )
        return prepared

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
            context=prepared.context_record(
                prepared.response_id,
                response.get("usage"),
                segment=segment,
                reply_bytes=len(join_rendered((i.kind, i.rendered) for i in outputs)),
            ),
        )
        self._stop_keeper(prepared)
        committed = await self.responses.commit(new, conversation_lease=prepared.lease)
        prepared.done = True
        self._count(prepared, "stored" if committed else "not_stored")
        if not committed:
            return False
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
                conversation_version=prepared.parent.conversation_version if prepared.parent else None,
            )
        return True

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

    async def give_back(self, prepared: PreparedResponse) -> None:
        """The turn ends without a commit: its conversation is free again. Safe to call after a commit."""
        self._stop_keeper(prepared)
        self._count(prepared, "not_stored")
        if prepared.lease is not None and not prepared.done and prepared.turn.conversation_id is not None:
            prepared.done = True
            await self.conversations.release(prepared.turn.conversation_id, prepared.lease)
