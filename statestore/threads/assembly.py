"""Pure functions from stored parts and a new turn to the bytes statestore stores and forwards (docs/protocol.md §2,
§3).

Stored messages are canonical JSON bytes; a rebuild concatenates them and never parses them again. A rebuilt body
is laid out as: this turn's own fields in the client's order, then `system`, `tools`, and `messages` last, so the
same thread state always yields the same bytes.
"""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

import orjson

# The keys under which the SDK finds content blocks when it strips replayed cache_control markers; other keys (a
# tool's `input`, say) hold free-form data that may legitimately contain a "cache_control" key.
KEYS_THAT_HOLD_BLOCKS = ("content", "source", "tool", "definition", "tool_references")


def without_cache_control(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            key: without_cache_control(item) if key in KEYS_THAT_HOLD_BLOCKS else item
            for key, item in value.items()
            if key != "cache_control"
        }
    if isinstance(value, list):
        return [without_cache_control(item) for item in value]
    return value


def count_cache_markers(value: Any) -> int:
    """Explicit block `cache_control` markers in a message, a system value or a tools list."""
    if isinstance(value, dict):
        own = 1 if value.get("cache_control") is not None else 0
        return own + sum(count_cache_markers(value[key]) for key in KEYS_THAT_HOLD_BLOCKS if key in value)
    if isinstance(value, list):
        return sum(count_cache_markers(item) for item in value)
    return 0


def _marks(value: Any) -> tuple[int, bool]:
    """(explicit block markers, whether any `cache_control` key is there at all, null ones included)."""
    if isinstance(value, dict):
        present = "cache_control" in value
        count = 1 if present and value["cache_control"] is not None else 0
        for key in KEYS_THAT_HOLD_BLOCKS:
            if key in value:
                inner_count, inner_present = _marks(value[key])
                count += inner_count
                present = present or inner_present
        return count, present
    if isinstance(value, list):
        count, present = 0, False
        for item in value:
            inner_count, inner_present = _marks(item)
            count += inner_count
            present = present or inner_present
        return count, present
    return 0, False


class NewMessages(NamedTuple):
    stored: list[bytes]  # as the thread keeps them: block markers dropped
    forwarded: list[bytes]  # as this turn sends them: markers kept
    markers: int


def encode_new_messages(messages: list[Any]) -> NewMessages:
    """A turn's new messages, each encoded once: a message with no `cache_control` key is the same bytes stored and
    forwarded (the common case); only one with a marker is encoded twice."""
    stored: list[bytes] = []
    forwarded: list[bytes] = []
    markers = 0
    for message in messages:
        count, present = _marks(message)
        markers += count
        encoded = orjson.dumps(message)
        forwarded.append(encoded)
        stored.append(stored_message(message) if present else encoded)
    return NewMessages(stored, forwarded, markers)


def count_tool_markers(tools: Any) -> int:
    if not isinstance(tools, list):
        return 0
    return sum(count_cache_markers(tool) for tool in tools)


def fingerprint(value: Any) -> str | None:
    """A hash of the canonical JSON of a fixed field, or None when the field is absent."""
    if value is None:
        return None
    return hashlib.sha256(orjson.dumps(value, option=orjson.OPT_SORT_KEYS)).hexdigest()


def encode(value: Any) -> bytes:
    return orjson.dumps(value)


def stored_message(message: Any) -> bytes:
    """A message as the thread keeps it: its block markers dropped, since they belong to the turn that sent it."""
    return orjson.dumps(without_cache_control(message))


def stored_reply(content: Any) -> bytes:
    return orjson.dumps({"role": "assistant", "content": content})


def build_body(
    fields: dict[str, Any],
    *,
    system: bytes | None,
    tools: bytes | None,
    history: bytes,
    new_messages: list[bytes],
) -> bytes:
    """The upstream request body: `fields` (every field of this turn except thread, system, tools, messages), then
    the thread's system and tools, then the stored history followed by the turn's new messages."""
    parts: list[bytes] = [orjson.dumps(fields)[:-1]] if fields else [b"{"]
    separator = b"," if fields else b""
    if system is not None:
        parts += [separator, b'"system":', system]
        separator = b","
    if tools is not None:
        parts += [separator, b'"tools":', tools]
        separator = b","
    parts += [separator, b'"messages":[', history]
    if history and new_messages:
        parts.append(b",")
    parts += [b",".join(new_messages), b"]}"]
    return b"".join(parts)


def join_history(messages: list[bytes]) -> bytes:
    return b",".join(messages)
