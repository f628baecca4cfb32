"""Where a turn's context comes from: the chain head's (or the conversation's) pre-joined bytes in the cache, else a
join of the stored bytes in the database; and the one place `truncation` is applied."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import orjson

from statestore.policy import Policy
from statestore.responses.errors import previous_response_not_found
from statestore.responses.items import join_rendered, join_segments
from statestore.store.cache import CachedHistory, CacheKey, HistoryCache, conversation_key, response_key
from statestore.store.conversation_store import ConversationStore
from statestore.store.response_records import ResponseRow, StoredItem
from statestore.store.response_store import ResponseStore


def cache_key(response_id: str) -> CacheKey:
    """The entry of the chain's context that ends at this response."""
    return response_key(response_id)


def conversation_cache_key(conversation_id: str) -> CacheKey:
    return conversation_key(conversation_id)


def cached_chain(head: ResponseRow, cached: CachedHistory | None) -> CachedHistory | None:
    """`cached` (read beside `head`) when it is the context of `head` as it stands now, else None: it must hold the
    chain's segments (`depth + 1`) and, for a chain begun on a conversation, have been read at the conversation's
    version now. A stored response never changes, but a chain begun on a conversation reads that conversation's
    items, and an item deleted there must leave its context: the deletion drops the entries there are (Retention),
    and an entry written afterwards by a turn that read the context before the deletion carries the older version,
    which no later read accepts."""
    if cached is None or cached.count != head.depth + 1 or cached.version != head.conversation_version:
        return None
    return cached


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
    conversation_version: int | None = None,
) -> None:
    """The new head's context goes in the cache and its parent's entry goes (a branch from it reads the database):
    when the turn read the parent's entry, the entry itself moves to the new head with the turn's segment appended,
    so a long chain's context is not sent to the cache again every turn; else the context is put whole."""
    key = cache_key(response_id)
    # The parent's entry holds its depth + 1 = this response's depth joined segments. An entry that also holds a
    # conversation's version is put whole (a move counts segments only).
    movable = hit and parent_id is not None and context and segment and conversation_version is None
    if movable and parent_id is not None and await cache.move(cache_key(parent_id), key, depth, [segment], ttl_ms):
        return
    history = CachedHistory(depth + 1, join_segments([context, segment]), conversation_version)
    if parent_id is None:
        await cache.put(key, history, ttl_ms)
    else:
        await asyncio.gather(cache.put(key, history, ttl_ms), cache.delete(cache_key(parent_id)))


async def conversation_context(
    store: ConversationStore, conversation_id: str, *, position: int, cached: CachedHistory | None
) -> bytes:
    """The conversation's joined messages at `position` (read with the lease): the cached entry when it was made at
    that very position (only the commit that made a position writes its entry, and every change of the items moves
    the position), else a join from the database. A miss is not written back: the turn's commit writes the entry."""
    if cached is not None and cached.count == position and cached.version is None:
        return cached.joined
    return join_rendered(await store.context_items(conversation_id))


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
    elif hit and context and segment:
        await cache.append(key, leased_at, [segment], ttl_ms, new_count=position)
    else:
        await cache.put(key, CachedHistory(position, join_segments([context, segment])), ttl_ms)


# Tokens per byte of JSON when nothing better is known: the usual ratio for English text.
TOKENS_PER_BYTE = 0.25


@dataclass(frozen=True, slots=True)
class Window:
    """The context policy of PROTOCOL §9 as `truncation: "auto"` uses it: the model's window and the two ratios."""

    tokens: int
    trigger_ratio: float = 0.8
    target_ratio: float = 0.5

    @classmethod
    def of(cls, policy: Policy) -> Window | None:
        """Without a window there is nothing to truncate to; the strategy is this request's `truncation`, not the
        policy's `context_strategy` (which governs threads)."""
        if policy.context_window_tokens is None:
            return None
        return cls(policy.context_window_tokens, policy.context_trigger_ratio, policy.context_target_ratio)


def truncated(context: bytes, *, new_bytes: int, truncation: str, window: Window | None) -> bytes | None:
    """The context to send for `truncation: "auto"`, or None to send it whole ("disabled", no window, or under the
    trigger). Past `trigger * window` the oldest messages go, down to the earliest user message (a boundary: a tool
    result is its own role, so a call is never separated from its output) that brings the estimate under
    `target * window`, in one step; the latest boundary when none does."""
    if truncation != "auto" or window is None or not context:
        return None
    if (len(context) + new_bytes) * TOKENS_PER_BYTE <= window.trigger_ratio * window.tokens:
        return None
    # Only a turn past the trigger parses its context; stored bytes are orjson's own, so they round-trip exactly.
    pieces = [orjson.dumps(message) for message in orjson.loads(b"[" + context + b"]")]
    boundaries = [i for i, piece in enumerate(pieces) if i > 0 and piece.startswith(b'{"role":"user"')]
    boundaries.append(len(pieces))
    kept = sum(len(piece) + 1 for piece in pieces)
    sizes = [len(piece) + 1 for piece in pieces]
    start = 0
    for boundary in boundaries:
        kept -= sum(sizes[start:boundary])
        start = boundary
        if (kept + new_bytes) * TOKENS_PER_BYTE <= window.target_ratio * window.tokens:
            break
    return b",".join(pieces[start:])
