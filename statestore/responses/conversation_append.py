"""`POST /v1/conversations/{id}/items` as a turn of its own: the conversation taken under the append's turn id (its
lease), the items committed only while that lease is the append's, and a commit whose answer was lost settled as
every turn's is (core/lost_commit.py). So neither a commit carried out twice nor a client's retry after a lost
acknowledgement adds the items twice. The owner's policy bounds an append as it bounds a turn
(core/policy_enforcement.py): one that would take the conversation over `max_messages` or `max_thread_bytes` is
refused, nothing stored; so is a conversation created with items over them (`items_measures`), and an append once
the owner's storing is turned off (threads_enabled), as a turn on the conversation is."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import anyio

from statestore.core.leased_log import CONVERSATIONS, LeasedLog
from statestore.core.lost_commit import settle_lost_commit
from statestore.core.policy_enforcement import PolicyRefusal, TurnMeasures, enforce
from statestore.policy import Policy
from statestore.responses.context import conversation_cache_key, conversation_context
from statestore.responses.errors import BadRequest, conversation_locked, conversation_not_found, policy_error
from statestore.responses.items import join_rendered
from statestore.responses.prepared import count_messages
from statestore.store.cache import HistoryCache
from statestore.store.conversation_store import ConversationStore, Locked
from statestore.store.engine import DATABASE_ERRORS, UNSTORABLE_VALUE_ERRORS
from statestore.store.response_records import StoredItem
from statestore.threads.ids import new_lease_token

# An append holds the conversation for one statement; a replica that dies between the two frees it this soon, or as
# soon as a turn's lease would (STATESTORE_LEASE_SECONDS) when that is shorter: an operator who shortens the lease
# for a quick takeover gets it on an append too.
APPEND_LEASE_MS = 30_000


async def append_items(
    leased_log: LeasedLog,
    conversations: ConversationStore,
    owner: str,
    conversation_id: str,
    items: Sequence[StoredItem],
    *,
    cache: HistoryCache,
    policy: Policy,
    now_ms: int,
    lease_ms: int,
) -> None:
    """Append `items`, or raise the refusal (404, 409: a turn holds the conversation; 400: over the policy's bounds)
    or ServiceUnavailable (the store unavailable; the 503 says whether the items were stored). `lease_ms`: a turn's
    lease, which bounds the append's."""
    turn = new_lease_token()
    until_ms = now_ms + min(APPEND_LEASE_MS, lease_ms)
    taken = await leased_log.take_conversation(
        owner=owner, conversation_id=conversation_id, token=turn, now_ms=now_ms, until_ms=until_ms
    )
    if taken is None:
        refusal = await conversations.refusal(owner, conversation_id, now_ms)
        raise conversation_locked() if isinstance(refusal, Locked) else conversation_not_found(conversation_id)
    position = taken[0]
    try:
        await _check_limits(conversations, owner, conversation_id, items, cache=cache, policy=policy, position=position)
    except BaseException:
        await _give_back(leased_log, conversation_id, turn)
        raise
    try:
        append = await conversations.append_of(owner, conversation_id, items, token=turn, position=position)
        stored = append is not None and await leased_log.commit_append(*append)
    except UNSTORABLE_VALUE_ERRORS:
        await _give_back(leased_log, conversation_id, turn)
        raise  # the request's fault (a 400): nothing was stored
    except DATABASE_ERRORS as exc:

        async def fence() -> None:
            await leased_log.release(CONVERSATIONS, conversation_id, turn)

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
        await _give_back(leased_log, conversation_id, turn)
        raise
    if not stored:  # the lease ran out and was taken over (or the conversation deleted): nothing stored
        raise conversation_locked()


async def _check_limits(
    conversations: ConversationStore,
    owner: str,
    conversation_id: str,
    items: Sequence[StoredItem],
    *,
    cache: HistoryCache,
    policy: Policy,
    position: int,
) -> None:
    """The policy's bounds, measured as a turn measures them (the conversation's messages and bytes with the new
    ones), less the reply an append does not ask for; and whether the owner may store at all (threads_enabled, which
    may have been turned off since the conversation was created: a turn on it is refused then, and so is an append)."""
    cached = await cache.get(conversation_cache_key(conversation_id))
    context = await conversation_context(conversations, owner, conversation_id, position=position, cached=cached)
    try:
        enforce(policy, items_measures(items, context=context))
    except PolicyRefusal as refusal:
        if refusal.field == "threads_enabled":  # an append has no `store` to turn off, as a turn has
            raise BadRequest(
                "Storing conversations is disabled by this deployment's retention policy.", code="storage_disabled"
            ) from None
        raise policy_error(refusal) from None


def items_measures(
    items: Sequence[StoredItem], *, context: bytes = b"", stores: bool = True, requested_ttl: bytes | None = None
) -> TurnMeasures:
    """Items stored without a reply, measured as a turn is: the messages and bytes of `context` (the conversation's
    stored items: none for a new one) with theirs. A conversation created with items is an append to an empty one."""
    new = join_rendered((i.kind, i.rendered) for i in items)
    return TurnMeasures(
        stores=stores,
        messages=count_messages(context) + count_messages(new),
        size=len(context) + sum(len(i.rendered) for i in items),
        requested_ttl=requested_ttl,
    )


async def _give_back(leased_log: LeasedLog, conversation_id: str, turn: str) -> None:
    """Free the conversation after an append that stored nothing; the lease runs out by itself if this fails."""
    with anyio.CancelScope(shield=True), contextlib.suppress(*DATABASE_ERRORS):
        await leased_log.release(CONVERSATIONS, conversation_id, turn)
