"""How a turn's records meet the threads table: the columns a lease returns and the record made of them, and the
values a commit sets for the context (shared by the Core statements in turn_writes and their callers)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import func

from statestore.store.schema import threads
from statestore.store.turn_records import LeasedThread, TurnCommit

LEASED_COLUMNS = (
    threads.c.id,
    threads.c.session_id,
    threads.c.system,
    threads.c.tools,
    threads.c.system_fp,
    threads.c.tools_fp,
    threads.c.output_config_fp,
    threads.c.fixed_markers,
    threads.c.head_position,
    threads.c.byte_count,
    threads.c.ttl_seconds,
    threads.c.base_position,
    threads.c.base_bytes,
    func.coalesce(func.length(threads.c.context_head), 0).label("head_bytes"),
    threads.c.context_tokens,
)


def leased_thread(m: Mapping[Any, Any]) -> LeasedThread:
    return LeasedThread(
        id=m["id"],
        session_id=m["session_id"],
        system=m["system"],
        tools=m["tools"],
        system_fp=m["system_fp"],
        tools_fp=m["tools_fp"],
        output_config_fp=m["output_config_fp"],
        fixed_markers=m["fixed_markers"],
        head_position=m["head_position"],
        byte_count=m["byte_count"],
        ttl_seconds=m["ttl_seconds"],
        base_position=m["base_position"],
        base_bytes=m["base_bytes"],
        head_bytes=m["head_bytes"],
        context_tokens=m["context_tokens"],
    )


def context_values(commit: TurnCommit) -> dict[str, Any]:
    move = commit.move
    values: dict[str, Any] = {"context_tokens": commit.context_tokens}
    if move is not None:
        values |= {
            "base_position": move.base_position,
            "base_bytes": move.base_bytes,
            "context_head": move.head,
            "context_compacted": threads.c.context_compacted + move.count("compacted"),
            "context_truncated": threads.c.context_truncated + move.count("truncated"),
            "context_summarized": threads.c.context_summarized + move.count("summarized"),
        }
    return values
