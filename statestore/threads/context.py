"""The Messages door's side of the context planner (docs/protocol.md §9, core/planner.py): its message format (sizes,
boundaries, the summary as a message), a thread's measured size, the summary request's body and reply, and the
compaction head. Pure functions; the service loads the rows and sends the summary request.

Only a turn whose estimate passes the trigger looks at stored messages, and then only at those from the base on:
every other turn's rebuild stays a join of stored bytes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from statestore.core import planner
from statestore.store.turn_records import LeasedThread, TurnUsage
from statestore.threads import assembly


def total_tokens(usage: TurnUsage) -> int:
    """A turn's context size, known exactly from the backend's usage: everything it read plus what it wrote."""
    return usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens + usage.output_tokens


def tokens_per_byte(leased: LeasedThread, fixed_bytes: int) -> float:
    """The thread's own ratio, measured by the backend after the last turn."""
    return planner.tokens_per_byte(leased.context_tokens, fixed_bytes + leased.context_bytes)


def estimate(leased: LeasedThread, fixed_bytes: int, new_bytes: int) -> int:
    """The next request's size in tokens: the context measured after the last turn, plus the new messages."""
    return planner.estimate(
        known_tokens=leased.context_tokens,
        known_bytes=fixed_bytes + leased.context_bytes,
        new_bytes=new_bytes,
        ratio=tokens_per_byte(leased, fixed_bytes),
    )


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


def summary_head(text: str) -> bytes:
    """The summary as the opening user message of the context, in place of what it replaces."""
    return orjson.dumps({"role": "user", "content": [{"type": "text", "text": planner.SUMMARY_PREFIX + text}]})


class MessagesFormat:
    """Messages API messages as the planner sees them: a boundary stands alone (a tool result is a user message
    of its own kind), and the joined history's commas are counted with the new messages, not here."""

    __slots__ = ()

    def size(self, message: bytes) -> int:
        return len(message)

    def boundaries(self, messages: Sequence[bytes]) -> list[bool]:
        return [is_boundary(message) for message in messages]

    def summary_message(self, text: str) -> bytes:
        return summary_head(text)


MESSAGES = MessagesFormat()
# Stand-ins for a turn's first new message, which the Messages format judges alone (and is known before encoding).
_A_BOUNDARY = b'{"role":"user","content":""}'
_NOT_A_BOUNDARY = b"{}"


@dataclass(frozen=True, slots=True)
class Cut:
    """Where the base moves: the stored messages from `position` on stay (position == the thread's head position:
    none stay, the context starts with the turn's new messages)."""

    position: int
    dropped_bytes: int  # stored bytes from the old base up to the new one


def first_new_stand_in(is_boundary: bool) -> bytes:
    """What the planner is shown of a turn's first new message: only whether it is a boundary counts."""
    return _A_BOUNDARY if is_boundary else _NOT_A_BOUNDARY


def position_at(rows: list[tuple[int, bytes]], index: int, head_position: int) -> int:
    """The position of the stored row at the planner's `index` (the head's position when the index is past them)."""
    return rows[index][0] if index < len(rows) else head_position


def summary_request(
    *,
    model: Any,
    max_tokens: int,
    system: bytes | None,
    tools: bytes | None,
    summarised: list[bytes],
    instructions: str | None,
) -> bytes:
    """The out-of-band request for a summary: the thread's own system, tools, then the planner's summary messages."""
    *history, ask = planner.summary_messages(summarised, instructions)
    return assembly.build_body(
        {"model": model, "max_tokens": max_tokens},
        system=system,
        tools=tools,
        history=assembly.join_history(history),
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
