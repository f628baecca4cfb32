"""The Responses front door's share of the admin stats: live responses and conversations, and the running totals
of those purged and erased."""

from __future__ import annotations

from collections.abc import Mapping

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection

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
    stats.update({f"{name}_total": int(totals.get(name, 0)) for name in _TOTALS})
    return stats
