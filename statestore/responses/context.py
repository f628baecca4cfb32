"""Where a turn's context comes from: the chain head's (or the conversation's) pre-joined bytes in the cache, else a
join of the stored bytes in the database; and where its context starts (`truncation: "auto"`, docs/protocol.md §9,
through the context planner with the Chat Completions format)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from statestore.content_keys import ContentSealer
from statestore.core import context_move, planner
from statestore.policy import Policy
from statestore.records import record
from statestore.responses.chat_format import CHAT, split
from statestore.responses.errors import previous_response_not_found
from statestore.responses.items import join_rendered, join_segments
from statestore.responses.request import chat_body
from statestore.store.cache import HistoryCache
from statestore.store.cache_entry import BRANCH_POINT, CachedHistory, CacheKey, conversation_key, response_key
from statestore.store.conversation_store import ConversationStore
from statestore.store.response_heads import encode_head
from statestore.store.response_records import ResponseRow, StoredItem
from statestore.store.response_store import ResponseStore
from statestore.store.thread_claims import Settle


def cache_key(response_id: str) -> CacheKey:
    """The entry of the chain's context that ends at this response."""
    return response_key(response_id)


def conversation_cache_key(conversation_id: str) -> CacheKey:
    return conversation_key(conversation_id)


async def chain_context(store: ResponseStore, head: ResponseRow, cached: CachedHistory | None) -> bytes:
    """The joined messages of the chain ending at `head`: `cached` (checked by `cached_chain`), else a join of the
    stored bytes."""
    if cached is not None:
        return cached.joined
    segments = await store.chain_segments(head)
    if segments is None:
        raise previous_response_not_found(head.id)
    return join_segments(join_rendered(segment) for segment in segments)


async def remember_head(
    cache: HistoryCache,
    *,
    response_id: str,
    depth: int,
    context: bytes,
    segment: bytes,
    parent_id: str | None,
    hit: bool,
    ttl_ms: int,
    sealer: ContentSealer,
    conversation_version: int | None = None,
    branched: bool = False,
    whole: bool = False,
    row: bytes | None = None,
    parent_row: ResponseRow | None = None,
) -> None:
    """The new head's context goes in the cache. When the turn read its parent's head entry, the entry itself moves to
    the new head with the turn's segment appended, so a long chain's context is not sent to the cache again every
    turn. A turn that branched (its parent's context came from the database, or from the parent's branch-point entry)
    puts its context whole and keeps its parent's as a branch point, so the next branch from the same response
    (regenerate, edit) reads one value, whatever its depth; those entries are bounded by the responses that were
    branched from, and expire with them. `row`: the new head's row, kept beside its context (store/response_heads.py);
    `parent_row`: the parent's row, kept beside its branch point (given when rows are kept)."""
    key = cache_key(response_id)
    then = Settle(row=row, claimed_head=None, token=None) if row is not None else None
    # The parent's entry holds its depth + 1 = this response's depth joined segments. An entry that also holds a
    # conversation's version is put whole (a move counts segments only).
    # `whole`: the entry read was sealed in many frames (one a turn): it is put back as one (CONSOLIDATE_FRAMES).
    movable = (
        hit
        and not whole
        and not branched
        and parent_id is not None
        and context
        and segment
        and conversation_version is None
    )
    if (
        movable
        and parent_id is not None
        and await cache.move(cache_key(parent_id), key, depth, [segment], ttl_ms, sealer=sealer, then=then)
    ):
        return
    history = CachedHistory(depth + 1, join_segments([context, segment]), conversation_version)
    if parent_id is None:
        await cache.put(key, history, ttl_ms, sealer=sealer, then=then)
    elif conversation_version is None and context and not hit:
        # A branch read from the database: its parent's context is kept for the branches after it.
        kept = CachedHistory(depth, context, BRANCH_POINT)
        encoded = encode_head(parent_row) if parent_row is not None else None
        kept_row = Settle(row=encoded, claimed_head=None, token=None) if encoded is not None else None
        await asyncio.gather(
            cache.put(key, history, ttl_ms, sealer=sealer, then=then),
            cache.put(cache_key(parent_id), kept, ttl_ms, sealer=sealer, then=kept_row),
        )
    elif branched:
        await cache.put(key, history, ttl_ms, sealer=sealer, then=then)  # the parent's branch-point entry stays
    else:
        await asyncio.gather(
            cache.put(key, history, ttl_ms, sealer=sealer, then=then), cache.delete(cache_key(parent_id))
        )


async def conversation_context(
    store: ConversationStore, owner: str, conversation_id: str, *, position: int, cached: CachedHistory | None
) -> bytes:
    """The conversation's joined messages at `position` (read with the lease): the cached entry when it was made at
    that very position (only the commit that made a position writes its entry, and every change of the items moves
    the position), else a join from the database. A miss is not written back: the turn's commit writes the entry."""
    if cached is not None and cached.count == position and cached.version is None:
        return cached.joined
    return join_rendered(await store.context_items(owner, conversation_id))


async def remember_conversation(
    cache: HistoryCache,
    conversation_id: str,
    *,
    leased_at: int,
    position: int,
    hit: bool,
    context: bytes,
    added: list[StoredItem],
    segment: bytes,
    ttl_ms: int,
    sealer: ContentSealer,
    whole: bool = False,
) -> None:
    """After the commit that moved the conversation from `leased_at` to `position`: its context then, for the next
    turn, appended to the entry the turn read (only when that entry still holds `leased_at`), else put whole. A stale
    writer (a commit overtaken before it got here) writes an older position, which the next turn's check rejects.
    The database joins a conversation's items in one run, consecutive function calls in one assistant message; a turn
    whose first sent item is a call could join onto a call that ends the context, so its entry is dropped instead and
    the next turn reads the database (byte-identical either way)."""
    key = conversation_cache_key(conversation_id)
    first = next((item.kind for item in added if item.kind != "none"), None)
    if first == "call":
        await cache.delete(key)
    elif hit and context and segment and not whole:
        await cache.append(key, leased_at, [segment], ttl_ms, new_count=position, sealer=sealer)
    else:
        await cache.put(key, CachedHistory(position, join_segments([context, segment])), ttl_ms, sealer=sealer)


def window_for(policy: Policy, truncation: str, *, on_conversation: bool) -> planner.Window | None:
    """The window `truncation: "auto"` manages: the owner's policy with its strategy, `truncate` when that is
    `none` (docs/responses.md); None for "disabled" (forwarded as rebuilt) or without a window. A conversation's turn
    truncates: its context is the conversation's items every turn (no base is stored with a conversation), and a
    summary it could not keep would be asked for again on every turn past the trigger."""
    if truncation != "auto":
        return None
    strategy = policy.context_strategy if policy.context_strategy != "none" and not on_conversation else "truncate"
    return planner.window_of(policy, strategy)


@record
class Base:
    """Where a turn's context starts: a head (a summary, stored on response `head_id`), then `context`, the chain's
    stored messages from the base on (its joined context's last bytes)."""

    context: bytes
    head: bytes | None = None
    head_id: str | None = None
    whole: bool = True  # the whole chain, no head: what a turn sends with nothing moved

    @property
    def size(self) -> int:
        """Its bytes in the backend's `messages`, a comma after each part."""
        return (len(self.head) + 1 if self.head else 0) + (len(self.context) + 1 if self.context else 0)


def chain_base(row: ResponseRow | None, joined: bytes) -> Base:
    """The base a turn continuing `row` starts from: where the row's turn left it, else the whole chain (`joined`).
    The kept bytes are counted from the end, so an item deleted from the conversation a chain began on, before the
    base, does not move it; one that leaves no message start there sends the whole chain (the trigger then decides
    again). Nothing is parsed."""
    whole = Base(joined)
    if row is None or (row.context_kept is None and row.context_head_id is None):
        return whole
    if row.context_head_id is not None and row.context_head is None:
        return whole  # the response holding the head is gone
    kept = len(joined) if row.context_kept is None else row.context_kept
    if kept > len(joined):
        return whole
    start = len(joined) - kept
    if kept and start and (joined[start - 1 : start] != b"," or not joined.startswith(b'{"role":', start)):
        return whole
    return Base(joined[start:], row.context_head, row.context_head_id, whole=False)


def kept_after(base: Base, segment: bytes) -> int:
    """The bytes of the chain's joined context the next turn keeps: the base's, then this turn's segment."""
    return len(base.context) + (1 if base.context and segment else 0) + len(segment)


ContextAction = Literal["truncated", "summarized", "compacted"]
# Sends a summary request body to the backend; the summary's text, or None when the request failed.
Summarize = Callable[[bytes], Awaitable[str | None]]


@record
class Move:
    base: Base  # the context after the move
    action: ContextAction
    summary_failed: bool


def summary_body(
    params: dict[str, Any],
    system: bytes,
    *,
    model: Any,
    max_tokens: int,
    summarised: list[bytes],
    instructions: str | None,
) -> bytes:
    """The out-of-band summary request (planner.summary_messages), with the turn's instructions and tools, so it
    shares the backend's prompt cache with the turns before; with tools the reply must be text."""
    fields: dict[str, Any] = {"model": model, "max_tokens": max_tokens}
    if "tools" in params:
        fields |= {"tools": params["tools"], "tool_choice": "none"}
    return chat_body(fields, [system, *planner.summary_messages(summarised, instructions)], stream=False)


async def plan(
    window: planner.Window | None,
    base: Base,
    *,
    fixed_bytes: int,
    new: bytes,
    ratio: float,
    summary_request: Callable[[list[bytes], int], bytes],
    summarize: Summarize | None,
    force: bool = False,
) -> Move | None:
    """The move this turn's context needs (docs/protocol.md §9), or None: no window, under the trigger, or nowhere to
    move. `fixed_bytes`: instructions and tools; `new`: the turn's input, joined. Past the trigger the base moves, in
    one step, to the earliest tool-safe boundary that brings the estimate under the target; with `summarize`, what is
    dropped is summarised first, and the summary opens the context."""
    if window is None:
        return None
    size = fixed_bytes + base.size + len(new)
    estimated = planner.estimate(known_tokens=0, known_bytes=size, new_bytes=0, ratio=ratio)
    # `force`: the backend refused the turn as too long, whatever the estimate says (docs/protocol.md §9).
    if not force and not planner.passes_trigger(window, estimated):
        return None
    # Only a turn past the trigger parses its context (stored bytes are orjson's own: they round-trip exactly).
    messages = ([base.head] if base.head else []) + split(base.context)
    added = split(new)

    ask_summary: context_move.AskSummary | None = None
    if summarize is not None:
        send = summarize

        async def ask_summary(summarised: list[bytes], budget: int) -> str | None:
            return await send(summary_request(summarised, budget))

    moved = await context_move.summarize_or_truncate(
        window,
        CHAT,
        messages,
        has_head=base.head is not None,
        first_new=added[0] if added else None,
        fixed_bytes=fixed_bytes,
        new_bytes=len(new),
        ratio=ratio,
        ask_summary=ask_summary,
    )
    if moved is None:
        return None
    kept = b",".join(messages[moved.cut.index :])
    if moved.summary is not None:
        return Move(Base(kept, CHAT.summary_message(moved.summary), None, whole=False), "summarized", False)
    return Move(Base(kept, whole=False), "truncated", moved.summary_failed)
