"""A turn's compaction (docs/responses.md, "Compaction"), before its backend body is built: when the context it would
send passes the threshold, the context becomes the user messages that fit in a quarter of the threshold, then the
summary of it all (responses/compaction.py), and the turn's output opens with the compaction item. A summary that
fails truncates to half the threshold instead, and says so (docs/protocol.md §9)."""

from __future__ import annotations

from dataclasses import replace

from statestore.core import planner
from statestore.responses import context
from statestore.responses.chat_format import split
from statestore.responses.compaction import compacted_head, compaction_item, newest_that_fit, user_messages
from statestore.responses.compaction_seal import CompactionSeal
from statestore.responses.context import Base, Move, Summarize
from statestore.responses.items import join_rendered
from statestore.responses.prepared import PreparedResponse


def compact_threshold(prepared: PreparedResponse) -> int | None:
    """Tokens past which the turn compacts: the request's, else the trigger of the owner's window (if any)."""
    turn, policy = prepared.turn, prepared.policy
    if not turn.compaction:
        return None
    if turn.compact_threshold is not None:
        return turn.compact_threshold
    tokens = policy.context_window_tokens if policy is not None else None
    if policy is None or not isinstance(tokens, int) or not tokens:
        return None
    return int(tokens * policy.context_trigger_ratio)


async def compact(prepared: PreparedResponse, summarize: Summarize | None, seal: CompactionSeal | None) -> bool:
    """True when the context moved (compacted, or truncated after a failed summary): `plan_context` then has
    nothing to do."""
    threshold = compact_threshold(prepared)
    if threshold is None or summarize is None or seal is None:
        return False
    system = prepared.system_message()
    fixed = prepared.fixed_bytes(system)
    new = join_rendered((i.kind, i.rendered) for i in prepared.inputs)
    base = prepared.base
    ratio = planner.tokens_per_byte(*prepared.measured)
    size = fixed + base.size + len(new)
    if planner.estimate(known_tokens=0, known_bytes=size, new_bytes=0, ratio=ratio) <= threshold:
        return False
    # Only a turn past its threshold parses its context (as plan_context does).
    messages = (split(base.head) if base.head else []) + split(base.context)
    if not messages:
        return False  # the turn's own input passes the threshold: nothing before it to compact
    policy = prepared.policy
    body = context.summary_body(
        prepared.turn.chat_params,
        system,
        model=(policy.summary_model if policy else None) or prepared.turn.model,
        max_tokens=max(256, threshold // 4),
        summarised=messages,
        instructions=policy.summary_instructions if policy else None,
    )
    summary = await summarize(body)
    if summary is None:
        window = planner.Window("truncate", threshold, trigger_ratio=1.0, target_ratio=0.5)
        moved = await context.plan(
            window,
            base,
            fixed_bytes=fixed,
            new=new,
            ratio=ratio,
            summary_request=lambda _summarised, _budget: b"",
            summarize=None,
            force=True,
        )
        prepared.moved = replace(moved, summary_failed=True) if moved is not None else None
        return moved is not None
    users = newest_that_fit(user_messages(messages), threshold / 4 / ratio)
    prepared.moved = Move(Base(b"", compacted_head(users, summary), None, whole=False), "compacted", False)
    prepared.compaction = compaction_item(seal, summary, prepared.principal.owner)
    return True
