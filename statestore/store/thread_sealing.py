"""A thread's content at rest (encryption on): what it is sealed under and what each sealed value is bound to.

Every value is sealed under the data key of the thread's erasure scope: its owner, its tenant and the
`metadata.user_id` the thread row holds (the first one a turn gave: the row keeps it by COALESCE). Its associated
data names its row, so a value copied to another row, position, field or owner does not open. With encryption off
nothing here runs: callers test `ContentKeys.enabled` (or the sealer's identity) first.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Literal

from statestore.content_keys import ContentKeys, Scope, row_data
from statestore.errors import UnopenableContent
from statestore.store.turn_records import LeasedThread

log = logging.getLogger(__name__)

ThreadField = Literal["system", "tools", "context_head"]


def thread_scope(owner: str, tenant_id: str | None, user_id: str | None) -> Scope:
    return Scope(owner, tenant_id, user_id)


def message_data(owner: str, thread_id: str, position: int) -> bytes:
    """Associated data of thread_messages.body at (thread, position)."""
    return row_data("tm", owner, thread_id, position)


def field_data(owner: str, thread_id: str, field: ThreadField) -> bytes:
    """Associated data of a threads column (system, tools, the context head)."""
    return row_data("thr", owner, thread_id, field)


def context_data(owner: str, thread_id: str, position: int) -> bytes:
    """Associated data of a row of a rebuild: position -1 is the thread's context head."""
    if position < 0:
        return field_data(owner, thread_id, "context_head")
    return message_data(owner, thread_id, position)


async def open_rows(
    content: ContentKeys, values: Sequence[bytes], associated: Sequence[bytes], *, table: str, thread_id: str
) -> list[bytes]:
    """The plaintexts of a thread's values, opened together (one key lookup). When one does not open, the log names
    the row it came from (ids only) before the error goes up: the thread, and which of its values."""
    try:
        return await content.open_many(values, associated, row=f"{table} {thread_id}")
    except UnopenableContent:
        for index, (value, data) in enumerate(zip(values, associated, strict=True)):
            try:
                await content.open(value, data, row=f"{table} {thread_id}")
            except UnopenableContent:
                log.error(
                    "a thread's stored value does not open",
                    extra={"table": table, "thread_id": thread_id, "value_index": index},
                )
                raise
        raise


async def opened_thread(content: ContentKeys, leased: LeasedThread) -> LeasedThread:
    """A thread's row as read (leased, or read for a count) with its system and tools opened (one key lookup for
    both)."""
    values: list[bytes] = []
    data: list[bytes] = []
    if leased.system is not None:
        values.append(leased.system)
        data.append(field_data(leased.owner, leased.id, "system"))
    if leased.tools is not None:
        values.append(leased.tools)
        data.append(field_data(leased.owner, leased.id, "tools"))
    if not values:
        return leased
    opened = await open_rows(content, values, data, table="threads", thread_id=leased.id)
    system = opened.pop(0) if leased.system is not None else None
    tools = opened.pop(0) if leased.tools is not None else None
    return replace(leased, system=system, tools=tools)
