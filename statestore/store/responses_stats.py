"""The Responses front door's share of the admin stats: live responses and conversations, those awaiting purge, and
the running totals of those purged and erased, and background turns by status."""

from __future__ import annotations

from collections.abc import Mapping

from sqlalchemy import ColumnElement, func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from statestore.store.background_store import background_counts
from statestore.store.schema import conversations, responses

_TOTALS = ("purged_responses", "erased_responses", "purged_conversations", "erased_conversations")


async def responses_stats(
    conn: AsyncConnection, *, now_ms: int, tenant_id: str | None, totals: Mapping[str, int]
) -> dict[str, int]:
    stats: dict[str, int] = {}
    for name, table in (("live_responses", responses), ("live_conversations", conversations)):
        where = [table.c.expires_ms > now_ms]
        if tenant_id is not None:
            where.append(table.c.tenant_id == tenant_id)
        stats[name] = int((await conn.execute(select(func.count()).select_from(table).where(*where))).scalar_one())
    stats.update(await _awaiting_purge(conn, now_ms=now_ms, tenant_id=tenant_id))
    stats.update({f"{name}_total": int(totals.get(name, 0)) for name in _TOTALS})
    stats.update(await background_counts(conn, now_ms=now_ms, tenant_id=tenant_id))
    return stats


async def _awaiting_purge(conn: AsyncConnection, *, now_ms: int, tenant_id: str | None) -> dict[str, int]:
    """What the next purge would delete: the responses of trees whose every response has expired (a tree is kept
    while any of its responses is live), and expired conversations."""
    trees = select(responses.c.root_id).group_by(responses.c.root_id).having(func.max(responses.c.expires_ms) <= now_ms)
    in_trees: list[ColumnElement[bool]] = [responses.c.root_id.in_(trees)]
    expired: list[ColumnElement[bool]] = [conversations.c.expires_ms <= now_ms]
    if tenant_id is not None:
        in_trees.append(responses.c.tenant_id == tenant_id)
        expired.append(conversations.c.tenant_id == tenant_id)
    count_responses = select(func.count()).select_from(responses).where(*in_trees)
    count_conversations = select(func.count()).select_from(conversations).where(*expired)
    return {
        "expired_responses_awaiting_purge": int((await conn.execute(count_responses)).scalar_one()),
        "expired_conversations_awaiting_purge": int((await conn.execute(count_conversations)).scalar_one()),
    }
