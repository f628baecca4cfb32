"""A Responses turn once checked and prepared: what it sends (its context, planned against the owner's window) and
what its commit will store of that context. Made by `ResponseTurns.prepare` (responses/turns.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from statestore.auth import Principal
from statestore.core import planner
from statestore.core.lease_keeper import LeaseKeeper
from statestore.metrics import ThreadTurnOutcome
from statestore.policy import Policy
from statestore.responses import context
from statestore.responses.context import (
    Base,
    Move,
    Summarize,
    chain_base,
    kept_after,
)
from statestore.responses.items import join_rendered
from statestore.responses.request import TurnRequest, chat_body
from statestore.store.response_records import ContextRecord, ResponseRow, StoredItem

# The fewest bytes a rendered Chat Completions message takes (`{"role":"user","content":""}` is 28): a context of N
# bytes carries at most N / this messages.
_FEWEST_MESSAGE_BYTES = 24


def count_messages(joined: bytes) -> int:
    """The Chat Completions messages in `joined` (a context's or new items' joined renderings)."""
    return len(orjson.loads(b"[" + joined + b"]")) if joined else 0


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
    window: planner.Window | None = None  # the context policy `truncation: "auto"` applies (docs/protocol.md §9)
    lease: str | None = None
    position: int = 0  # on a conversation: its position when the lease was taken
    cache_hit: bool = False  # the context came from the cache (its entry can be extended in place)
    cache_frames: int = 0  # the sealed frames the entry read was kept in (0: clear)
    branch_point: bool = False  # ... from its parent's branch-point entry (kept, never moved: responses/context.py)
    keeper: LeaseKeeper | None = None
    done: bool = field(default=False)
    moved: Move | None = None  # the context's base moved for this request (`plan_context`)
    outcome: ThreadTurnOutcome | None = None  # as counted in the metrics, once
    committing: bool = False  # the commit has begun: a background turn's cancel no longer stops it
    sent_bytes: int = 0  # the bytes of `messages` and tools the backend counts the prompt of
    # The backend's token count of the last turn (the parent's, or the conversation's) and the bytes it counted.
    measured: tuple[int, int] = (0, 0)
    compaction: dict[str, Any] | None = None  # the compaction item this turn made (`compact`), its output's first
    # The committed row and this turn's segment, where Redis keeps chain heads' rows: what a WebSocket connection holds
    # of the chain's head, its context joined only there (api/responses_socket.py).
    stored: tuple[ResponseRow, bytes] | None = None
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
        """Move the context's base when this turn passes the trigger (docs/protocol.md §9): before `backend_body`.
        `forced`: the window of a turn the backend refused, cut whatever the estimate says, at the refusal's `ratio`."""
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

    def messages_sent(self, limit: int) -> int | None:
        """The messages the rebuilt request carries (its context as the previous turn left it, the new inputs, and
        the reply), when they could number more than `limit`; None when they cannot, which costs no parse."""
        base = self.base
        new_bytes = sum(len(i.rendered) for i in self.inputs)
        if (base.size + new_bytes) // _FEWEST_MESSAGE_BYTES + 1 <= limit:
            return None
        new = join_rendered((i.kind, i.rendered) for i in self.inputs)
        return (1 if base.head else 0) + count_messages(base.context) + count_messages(new) + 1

    def backend_body(self) -> bytes:
        system = self.system_message()
        new = join_rendered((i.kind, i.rendered) for i in self.inputs)
        base = self.moved.base if self.moved is not None else self.base
        segments = [system, base.head or b"", base.context, new]
        self.sent_bytes = self.fixed_bytes(system) + base.size + len(new)
        return chat_body(self.turn.chat_params, segments, stream=self.turn.stream)

    def estimated_tokens(self) -> int:
        """statestore's estimate of the prompt `backend_body` sent: its bytes at the chain's own tokens per byte, as
        the planner's trigger reckons it (core/planner.py)."""
        return planner.estimate(
            known_tokens=0, known_bytes=self.sent_bytes, new_bytes=0, ratio=planner.tokens_per_byte(*self.measured)
        )

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
