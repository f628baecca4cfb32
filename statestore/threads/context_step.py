"""Moving a thread's base before a turn (docs/protocol.md §9, `truncate` and `summarize`): taken only when the turn's
estimate passes the policy's trigger, in one step down to the target, so the prefix then stays byte-identical (and
cached at the backend) until the next trigger."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from statestore.core import context_move, planner
from statestore.errors import InternalError
from statestore.policy import Policy
from statestore.store.thread_store import ThreadStore
from statestore.store.turn_records import ContextAction, ContextMove, LeasedThread, TurnUsage
from statestore.threads import assembly, context
from statestore.threads.turn import ThreadTurn

log = logging.getLogger(__name__)

# Sends a summary request body to the backend; the reply's text, or None when the request failed.
Summarize = Callable[[bytes], Awaitable[str | None]]


@dataclass(frozen=True, slots=True)
class ContextStep:
    move: ContextMove
    joined: bytes  # the new context, pre-joined
    messages: int  # messages in it
    size: int  # its bytes
    action: ContextAction
    summary_failed: bool


async def step(
    repository: ThreadStore,
    leased: LeasedThread,
    turn: ThreadTurn,
    policy: Policy,
    new_messages: list[bytes],
    *,
    summarize: Summarize | None,
    forced: planner.Window | None = None,
    ratio: float | None = None,
) -> ContextStep | None:
    """The base move this turn needs, or None when the estimate is under the trigger (or nothing can move).
    `forced`: the window of a turn the backend refused as too long, cut to its target whatever the estimate says,
    at `ratio` (the tokens per byte the refusal counted) when it stated one."""
    fields = turn.fields
    first_new_is_boundary = bool(turn.messages) and context.is_boundary_message(turn.messages[0])
    window = forced or planner.window_of(policy)
    if window is None:
        return None
    fixed = len(leased.system or b"") + len(leased.tools or b"")
    new_bytes = sum(map(len, new_messages)) + len(new_messages)
    if forced is None and not planner.passes_trigger(window, context.estimate(leased, fixed, new_bytes)):
        return None
    rows = await repository.load_context(leased.id, owner=leased.owner)
    if sum(1 for position, _ in rows if position >= 0) != leased.head_position - leased.base_position:
        log.error("thread rows disagree with its head position", extra={"thread_id": leased.id})
        raise InternalError("the stored thread is inconsistent")
    ratio = ratio or context.tokens_per_byte(leased, fixed)

    ask_summary: context_move.AskSummary | None = None
    if summarize is not None:
        send = summarize

        async def ask_summary(summarised: list[bytes], budget: int) -> str | None:
            return await send(
                context.summary_request(
                    model=policy.summary_model or fields.get("model"),
                    max_tokens=budget,
                    system=leased.system,
                    tools=leased.tools,
                    summarised=summarised,
                    instructions=policy.summary_instructions,
                )
            )

    moved = await context_move.summarize_or_truncate(
        window,
        context.MESSAGES,
        [body for _, body in rows],
        has_head=bool(rows) and rows[0][0] < 0,
        first_new=context.first_new_stand_in(first_new_is_boundary),
        fixed_bytes=fixed,
        new_bytes=new_bytes,
        ratio=ratio,
        ask_summary=ask_summary,
    )
    if moved is None:
        return None
    summary, summary_failed = moved.summary, moved.summary_failed
    cut = context.Cut(context.position_at(rows, moved.cut.index, leased.head_position), moved.cut.dropped_bytes)
    head = context.summary_head(summary) if summary is not None else None
    kept = [body for position, body in rows if position >= cut.position]
    context_rows = [head, *kept] if head is not None else kept
    action: ContextAction = "summarized" if head is not None else "truncated"
    return ContextStep(
        move=ContextMove(
            base_position=cut.position,
            base_bytes=leased.base_bytes + cut.dropped_bytes,
            head=head,
            actions=(action,),
        ),
        joined=assembly.join_history(context_rows),
        messages=len(context_rows),
        size=sum(map(len, context_rows)),
        action=action,
        summary_failed=summary_failed,
    )


def after_reply(
    move: ContextMove | None,
    usage: TurnUsage,
    *,
    compaction: bytes | None,
    sent_bytes: int,
    fixed_bytes: int,
    reply_position: int,
    archive_bytes: int,
) -> tuple[ContextMove | None, int]:
    """The base move a turn stores and the context's size in tokens after it: the usage's total; or, when the reply
    compacted (its base moves past the reply, which becomes the head), the share of that total the compaction block
    and the fixed fields stand for."""
    tokens = context.total_tokens(usage)
    if compaction is None:
        return move, tokens
    tokens = -(-tokens * (fixed_bytes + len(compaction)) // max(1, sent_bytes))
    earlier = move.actions if move is not None else ()
    return ContextMove(
        base_position=reply_position,
        base_bytes=archive_bytes,
        head=compaction,
        actions=(*earlier, "compacted"),
    ), tokens
