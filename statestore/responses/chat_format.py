"""Chat Completions messages (the Responses door's rendering of its items) as the context planner sees them
(core/planner.py): their size in a joined context, where a context may start, a summary as a message, and the
text of a summary reply."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from statestore.core import planner


class ChatFormat:
    """A boundary is a user message that does not stand between an assistant's `tool_calls` and their `tool`
    results: a backend refuses a `tool` message whose call is not before it, and a call left without its result."""

    __slots__ = ()

    def size(self, message: bytes) -> int:
        return len(message) + 1  # the comma that joins it to the next

    def boundaries(self, messages: Sequence[bytes]) -> list[bool]:
        flags: list[bool] = []
        open_calls: set[Any] = set()
        for raw in messages:
            try:
                message = orjson.loads(raw)
            except orjson.JSONDecodeError:
                message = None
            if not isinstance(message, dict):
                flags.append(False)
                open_calls = set()
                continue
            role = message.get("role")
            if role == "tool":
                flags.append(False)
                open_calls.discard(message.get("tool_call_id"))
                continue
            flags.append(role == "user" and not open_calls)
            calls = message.get("tool_calls") if role == "assistant" else None
            open_calls = (
                {call.get("id") for call in calls if isinstance(call, dict)} if isinstance(calls, list) else set()
            )
        return flags

    def summary_message(self, text: str) -> bytes:
        return orjson.dumps({"role": "user", "content": planner.SUMMARY_PREFIX + text})


CHAT = ChatFormat()


def split(joined: bytes) -> list[bytes]:
    """A joined run of messages as one canonical JSON message each: stored bytes are orjson's own, so each
    round-trips exactly. Only a turn past the trigger does this."""
    if not joined:
        return []
    return [orjson.dumps(message) for message in orjson.loads(b"[" + joined + b"]")]


def summary_text(reply: Any) -> str | None:
    """The text of a summary reply (a chat completion), or None when it has none."""
    choices = reply.get("choices") if isinstance(reply, dict) else None
    first = choices[0] if isinstance(choices, list) and choices else None
    message = first.get("message") if isinstance(first, dict) else None
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, str):
        return None
    return content.strip() or None
