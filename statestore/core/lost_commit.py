"""Settling a commit whose acknowledgement was lost, on either door.

A commit whose connection failed may have committed all the same: the database carried it out and only its answer
to statestore was lost. Answering 503 then would make the client retry a turn that is already stored (a second copy
of a conversation's items, a sibling on a chain). So the turn is settled instead: first fenced, so that a commit
still on its way to the database changes nothing (each door says how: a thread's head or a conversation's lease
given back, a chain's response id waited out); then one read decides. Stored: the turn is answered as stored. Not
stored: it never will be, and the client gets a 503 that says so, which it may retry safely.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

from statestore.errors import ServiceUnavailable
from statestore.store.engine import DATABASE_ERRORS

log = logging.getLogger(__name__)

Fenced = TypeVar("Fenced")


async def settle_lost_commit(
    error: BaseException,
    *,
    fence: Callable[[], Awaitable[Fenced]],
    is_stored: Callable[[], Awaitable[bool]],
    not_stored: Callable[[Fenced], Awaitable[None]],
    store: str,
    log_id: str,
) -> bool:
    """Settle the commit that failed with `error`: `fence` (what it returns is handed to `not_stored`), then
    `is_stored`. Returns True when the turn was stored; raises ServiceUnavailable otherwise, after `not_stored` has
    freed what the fence took (shielded from cancellation). `store`: how the 503 names the store ("the response
    store"); `log_id`: the log (thread, conversation, chain) named in the log line, never its content."""
    try:
        fenced = await fence()
        stored = await is_stored()
    except DATABASE_ERRORS:
        # A lease runs out by itself; until the database answers, whether the turn was stored is unknown.
        raise ServiceUnavailable(f"{store} is unavailable; the turn may not have been stored") from error
    if stored:
        log.warning("a commit reported as failed had been stored", extra={"thread_id": log_id})
        return True
    with anyio.CancelScope(shield=True):
        await not_stored(fenced)
    raise ServiceUnavailable(f"{store} is unavailable; the turn was not stored") from error
