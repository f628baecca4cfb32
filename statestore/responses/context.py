"""Where a turn's context comes from: the chain head's pre-joined bytes in the cache, else a join of the stored
bytes in the database; and the one place `truncation` is applied."""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from statestore.responses.errors import previous_response_not_found
from statestore.responses.store import ResponseRow, ResponseStore
from statestore.store.cache import CachedHistory, HistoryCache
from statestore.threads.policy import Policy

CACHE_PREFIX = "resp:"


def cache_key(response_id: str) -> str:
    return CACHE_PREFIX + response_id


async def chain_context(store: ResponseStore, cache: HistoryCache, head: ResponseRow) -> bytes:
    """The joined messages of the chain ending at `head`. A cache entry is keyed by the response id and a stored
    response never changes, so any entry found is that response's context."""
    cached = await cache.get(cache_key(head.id))
    if cached is not None:
        return cached.joined
    joined = await store.chain_context(head)
    if joined is None:
        raise previous_response_not_found(head.id)
    return joined


async def remember_head(
    cache: HistoryCache, *, response_id: str, depth: int, joined: bytes, parent_id: str | None, ttl_ms: int
) -> None:
    """The new head's context goes in the cache; its parent's entry goes (a branch from it reads the database)."""
    await cache.put(cache_key(response_id), CachedHistory(depth + 1, joined), ttl_ms)
    if parent_id is not None:
        await cache.delete(cache_key(parent_id))


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
