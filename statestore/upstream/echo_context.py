"""The echo backend's context window (docs/protocol.md §9 needs a backend that runs out of room): a request over the
window is refused with the API's own "prompt is too long" error, and a `compact_20260112` context-management edit whose
trigger the request passes is honoured with a deterministic `compaction` block at the start of the reply.

As at the API, a request that carries a compaction block is counted from that block on: the backend ignores what
came before it."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

# The API's default trigger of a compact_20260112 edit.
DEFAULT_COMPACTION_TRIGGER = 150_000
COMPACTION_EDIT = "compact_20260112"


def _tokens(n_bytes: int) -> int:
    return -(-n_bytes // 4)


def _last_compaction(messages: Sequence[Any]) -> tuple[int, int] | None:
    """(message index, block index) of the last compaction block with content, or None."""
    for index in range(len(messages) - 1, -1, -1):
        content = messages[index].get("content") if isinstance(messages[index], dict) else None
        if not isinstance(content, list):
            continue
        for block_index in range(len(content) - 1, -1, -1):
            block = content[block_index]
            if isinstance(block, dict) and block.get("type") == "compaction" and block.get("content") is not None:
                return index, block_index
    return None


def effective_messages(messages: Sequence[Any]) -> list[Any]:
    """The messages the backend reads: from the last compaction block on (that block's message cut to it)."""
    found = _last_compaction(messages)
    if found is None:
        return list(messages)
    index, block_index = found
    first = dict(messages[index])
    first["content"] = first["content"][block_index:]
    return [first, *messages[index + 1 :]]


def input_tokens(request: Mapping[str, Any]) -> int:
    """One token per 4 bytes of the compact JSON of `system`, `tools` and the messages the backend reads."""
    n_bytes = sum(len(orjson.dumps(request[key])) for key in ("system", "tools") if key in request)
    messages = request.get("messages")
    if isinstance(messages, list):
        n_bytes += len(orjson.dumps(effective_messages(messages)))
    return _tokens(n_bytes)


def too_long(request: Mapping[str, Any], window: int | None) -> str | None:
    """The API's message for a request over the window, or None."""
    return None if window is None else prompt_too_long(input_tokens(request), window)


def prompt_too_long(tokens: int, window: int | None) -> str | None:
    if window is None or tokens <= window:
        return None
    return f"prompt is too long: {tokens} tokens > {window} maximum"


def compaction_trigger(request: Mapping[str, Any]) -> int | None:
    """The input-token trigger of the request's compact_20260112 edit, or None when it asks for none."""
    management = request.get("context_management")
    edits = management.get("edits") if isinstance(management, dict) else None
    if not isinstance(edits, list):
        return None
    for edit in edits:
        if isinstance(edit, dict) and edit.get("type") == COMPACTION_EDIT:
            trigger = edit.get("trigger")
            value = trigger.get("value") if isinstance(trigger, dict) else None
            return value if isinstance(value, int) and not isinstance(value, bool) else DEFAULT_COMPACTION_TRIGGER
    return None


def compaction_block(request: Mapping[str, Any]) -> dict[str, Any] | None:
    """The compaction block the reply opens with, when the request asks for compaction and passes its trigger: a
    deterministic summary of what it replaces (how many messages and tokens, a digest, and the opening and latest
    user text), so the same request compacts the same way."""
    trigger = compaction_trigger(request)
    if trigger is None or input_tokens(request) < trigger:
        return None
    replaced = effective_messages(request["messages"])
    encoded = orjson.dumps(replaced)
    texts = [_text_of(message) for message in replaced if isinstance(message, dict) and message.get("role") == "user"]
    texts = [text for text in texts if text]
    summary = (
        f"Compacted {len(replaced)} messages ({_tokens(len(encoded))} tokens, digest "
        f"{hashlib.sha256(encoded).hexdigest()[:16]}). "
        f"First user text: {texts[0][:200] if texts else '-'!s} | Latest user text: {texts[-1][:200] if texts else '-'}"
    )
    return {"type": "compaction", "content": summary}


def _text_of(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            block["text"] for block in content if isinstance(block, dict) and isinstance(block.get("text"), str)
        )
    return ""
