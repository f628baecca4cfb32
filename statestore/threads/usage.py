"""The backend's token usage of a reply, as the thread's totals add it up (docs/protocol.md §10)."""

from __future__ import annotations

from typing import Any

from statestore.store.turn_records import TurnUsage


def _count(usage: dict[str, Any], key: str) -> int:
    value = usage.get(key)
    # A backend that reports nothing, null, or nonsense adds nothing rather than failing a completed turn.
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 53:
        return value
    return 0


def usage_of(message: dict[str, Any]) -> TurnUsage:
    usage = message.get("usage")
    if not isinstance(usage, dict):
        return TurnUsage()
    return TurnUsage(
        input_tokens=_count(usage, "input_tokens"),
        output_tokens=_count(usage, "output_tokens"),
        cache_creation_input_tokens=_count(usage, "cache_creation_input_tokens"),
        cache_read_input_tokens=_count(usage, "cache_read_input_tokens"),
    )
