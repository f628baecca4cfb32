"""`POST /v1/conversations/{id}/items` as a turn of its own: the conversation taken under the append's turn id (its
lease), the items committed only while that lease is the append's, and a commit whose answer was lost settled as
every turn's is (core/lost_commit.py). So neither a commit carried out twice nor a client's retry after a lost
acknowledgement adds the items twice."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import anyio

from statestore.core.lost_commit import settle_lost_commit
from statestore.responses.errors import conversation_locked, conversation_not_found
from statestore.store.conversation_store import ConversationStore, Locked
from statestore.store.engine import DATABASE_ERRORS, UNSTORABLE_VALUE_ERRORS
from statestore.store.response_records import StoredItem
from statestore.threads.ids import new_lease_token

# An append holds the conversation for one statement; a replica that dies between the two frees it this soon.
APPEND_LEASE_MS = 30_000


async def append_items(
    conversations: ConversationStore, owner: str, conversation_id: str, items: Sequence[StoredItem], *, now_ms: int
) -> None:
    """Append `items`, or raise the refusal (404, 409: a turn holds the conversation) or ServiceUnavailable (the
    store unavailable; the 503 says whether the items were stored)."""
    turn = new_lease_token()
    try:
        position, *_ = await conversations.lease(
            owner, conversation_id, token=turn, now_ms=now_ms, until_ms=now_ms + APPEND_LEASE_MS
        )
    except Locked:
        raise conversation_locked() from None
    except LookupError:
        raise conversation_not_found(conversation_id) from None
    try:
        stored = await conversations.commit_append(owner, conversation_id, items, token=turn, position=position)
    except UNSTORABLE_VALUE_ERRORS:
        await _give_back(conversations, conversation_id, turn)
        raise  # the request's fault (a 400): nothing was stored
    except DATABASE_ERRORS as exc:

        async def fence() -> None:
            await conversations.release(conversation_id, turn)

        async def nothing(_: None) -> None:
            return None

        await settle_lost_commit(
            exc,
            fence=fence,
            is_stored=lambda: conversations.holds_append(conversation_id, position=position, item_id=items[0].item_id),
            not_stored=nothing,
            store="the conversation store",
            log_id=conversation_id,
        )
        return
    except BaseException:
        await _give_back(conversations, conversation_id, turn)
        raise
    if not stored:  # the lease ran out and was taken over (or the conversation deleted): nothing stored
        raise conversation_locked()


async def _give_back(conversations: ConversationStore, conversation_id: str, turn: str) -> None:
    """Free the conversation after an append that stored nothing; the lease runs out by itself if this fails."""
    with anyio.CancelScope(shield=True), contextlib.suppress(*DATABASE_ERRORS):
        await conversations.release(conversation_id, turn)
