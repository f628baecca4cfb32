"""The context a thread sends (PROTOCOL §9): when it nears the model's window, where to move the base, and what a
summary request looks like. Pure functions; the service loads the rows and sends the summary request.

Only a turn whose estimate passes the trigger looks at stored messages, and then only at those from the base on:
every other turn's rebuild stays a join of stored bytes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from statestore.policy import Policy
from statestore.store.turn_records import LeasedThread, TurnUsage
from statestore.threads import assembly

# Tokens per byte when a thread has no measured size yet: the usual ratio for English text in JSON.
DEFAULT_TOKENS_PER_BYTE = 0.25
SUMMARY_PREFIX = "Summary of the earlier part of this conversation:\n\n"
DEFAULT_SUMMARY_INSTRUCTIONS = (
    "Summarise the conversation above so that it can continue without it: the user's goals, the decisions made, "
    "facts and numbers established, tool results that still matter, and open questions. Write only the summary."
)


def total_tokens(usage: TurnUsage) -> int:
    """A turn's context size, known exactly from the backend's usage: everything it read plus what it wrote."""
    return usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens + usage.output_tokens


def tokens_per_byte(leased: LeasedThread, fixed_bytes: int) -> float:
    """The thread's own ratio, measured by the backend after the last turn."""
    size = fixed_bytes + leased.context_bytes
    if leased.context_tokens > 0 and size > 0:
        return leased.context_tokens / size
    return DEFAULT_TOKENS_PER_BYTE


def window_of(policy: Policy) -> int | None:
    """The window the policy manages, or None when the thread's context is forwarded as rebuilt."""
    if policy.context_strategy == "none" or not policy.context_window_tokens:
        return None
    return policy.context_window_tokens


def estimate(leased: LeasedThread, fixed_bytes: int, new_bytes: int) -> int:
    """The next request's size in tokens: the context measured after the last turn, plus the new messages."""
    ratio = tokens_per_byte(leased, fixed_bytes)
    known = leased.context_tokens or int((fixed_bytes + leased.context_bytes) * ratio)
    return known + int(new_bytes * ratio) + 1


def summary_budget(policy: Policy, window: int) -> int:
    """max_tokens of a summary request: a quarter of what the context is brought down to, at least 256."""
    return max(256, int(window * policy.context_target_ratio / 4))


def is_boundary(message: bytes) -> bool:
    """A user message that is not a tool result: where a context may start without separating a tool_use from its
    tool_result (a user turn after a tool_use must carry its result, so such a message never follows one)."""
    try:
        return is_boundary_message(orjson.loads(message))
    except orjson.JSONDecodeError:
        return False


def is_boundary_message(message: Any) -> bool:
    if not isinstance(message, dict) or message.get("role") != "user":
        return False
    content = message.get("content")
    if isinstance(content, list):
        return not any(isinstance(block, dict) and block.get("type") == "tool_result" for block in content)
    return isinstance(content, str)


@dataclass(frozen=True, slots=True)
class Cut:
    """Where the base moves: the stored messages from `position` on stay (position == the thread's head position:
    none stay, the context starts with the turn's new messages)."""

    position: int
    dropped_bytes: int  # stored bytes from the old base up to the new one


def plan_cut(
    rows: list[tuple[int, bytes]],
    *,
    head_position: int,
    first_new_is_boundary: bool,
    fixed_bytes: int,
    new_bytes: int,
    ratio: float,
    budget_tokens: float,
) -> Cut | None:
    """The earliest boundary that brings the request under `budget_tokens`, in one step (PROTOCOL §9); the latest
    boundary when none does; None when there is no boundary to move to. `rows` is the context as stored: (-1, head)
    first when there is one, then (position, bytes) from the base on."""
    stored = [(position, body) for position, body in rows if position >= 0]
    has_head = len(stored) != len(rows)
    candidates: list[tuple[int, int, int]] = []  # (position, bytes kept from there, bytes dropped before it)
    kept = sum(len(body) for _, body in stored)
    dropped = 0
    base = stored[0][0] if stored else head_position
    for position, body in stored:
        # The base itself is a place to move to only when a head stands before it (the head goes).
        if (position > base or has_head) and is_boundary(body):
            candidates.append((position, kept, dropped))
        kept -= len(body)
        dropped += len(body)
    if first_new_is_boundary and (stored or has_head):
        candidates.append((head_position, 0, dropped))
    if not candidates:
        return None
    for position, kept_bytes, dropped_bytes in candidates:
        if (fixed_bytes + kept_bytes + new_bytes) * ratio <= budget_tokens:
            return Cut(position, dropped_bytes)
    position, _, dropped_bytes = candidates[-1]
    return Cut(position, dropped_bytes)


def summary_request(
    *,
    model: Any,
    max_tokens: int,
    system: bytes | None,
    tools: bytes | None,
    summarised: list[bytes],
    instructions: str | None,
) -> bytes:
    """The out-of-band request for a summary: the thread's own system, tools and the messages to summarise (so it
    shares the prompt cache's prefix with the turns before), then the instructions as the last user message."""
    ask = orjson.dumps({"role": "user", "content": instructions or DEFAULT_SUMMARY_INSTRUCTIONS})
    return assembly.build_body(
        {"model": model, "max_tokens": max_tokens},
        system=system,
        tools=tools,
        history=assembly.join_history(summarised),
        new_messages=[ask],
    )


def summary_text(reply: Any) -> str | None:
    """The text of a summary reply (a Message), or None when it has none."""
    if not isinstance(reply, dict) or reply.get("type") != "message":
        return None
    content = reply.get("content")
    if not isinstance(content, list):
        return None
    text = "\n".join(
        block["text"]
        for block in content
        if isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)
    ).strip()
    return text or None


def summary_head(text: str) -> bytes:
    """The summary as the opening user message of the context, in place of what it replaces."""
    return orjson.dumps({"role": "user", "content": [{"type": "text", "text": SUMMARY_PREFIX + text}]})


def compaction_head(content: Any) -> bytes | None:
    """A reply cut to its (last) compaction block with non-null content and what follows it, or None when the reply
    holds no such block: the backend ignores everything before that block from then on, and so does the rebuild."""
    if not isinstance(content, list):
        return None
    for index in range(len(content) - 1, -1, -1):
        block = content[index]
        if isinstance(block, dict) and block.get("type") == "compaction" and block.get("content") is not None:
            return assembly.stored_reply(content[index:])
    return None
