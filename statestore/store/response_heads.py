"""A chain's head served from Redis: the continue by `previous_response_id` that finds the chain's context in the cache
reads the response's row from beside it, and takes no database round trip before the backend call.

A stored response never changes (no statement updates one); what ends it is a deletion (its tree, an erasure, the
purger), and each drops the response's cache entry after the database, row included. So a row is served only beside
the chain's cached context (the entry of the response it names, holding the chain's `depth + 1` segments), of the
owner asking, not expired, for a chain not begun on a conversation (whose version moves with the conversation's
items). Anything else is a miss, and the turn reads the row from the database as before. A release that keeps no rows
moves or drops the context without its row: a row without its context is never served.

The commit that stores a response writes its row with its context (store/cache_scripts.py MOVE, PUT_SETTLE);
a move takes the parent's row away with the parent's context, so Redis holds one row per cached chain head."""

from __future__ import annotations

from collections.abc import Callable

from statestore.records import record
from statestore.store.cache_entry import BRANCH_POINT, CachedHistory, CacheKey, response_key
from statestore.store.redis_rows import decode_fields, encode_fields
from statestore.store.resp import RedisClient
from statestore.store.response_records import ResponseRow

# The fields of a chain head's row, in their stored order (store/redis_rows.py).
_ROW_WIDTH = 12


@record
class ChainHead:
    """What one read found: the response's row when it is served, and the chain's cached context either way."""

    row: ResponseRow | None
    cached: CachedHistory | None


def cached_chain(head: ResponseRow, cached: CachedHistory | None) -> CachedHistory | None:
    """`cached` (read beside `head`) when it is the context of `head` as it stands now, else None: it must hold the
    chain's segments (`depth + 1`) and, for a chain begun on a conversation, have been read at the conversation's
    version now. A stored response never changes, but a chain begun on a conversation reads that conversation's
    items, and an item deleted there must leave its context: the deletion drops the entries there are (Retention),
    and an entry written afterwards by a turn that read the context before the deletion carries the older version,
    which no later read accepts."""
    if cached is None or cached.count != head.depth + 1:
        return None
    if cached.version == head.conversation_version:
        return cached
    # A branch point's entry: a chain not begun on a conversation reads no conversation, so no version to match.
    return cached if cached.version == BRANCH_POINT and head.conversation_version is None else None


def encode_head(row: ResponseRow) -> bytes | None:
    """The row a continue reads (its body aside: a continue does not read it), as kept beside the chain's context;
    None when it is not kept (a chain begun on a conversation, or a context head that is not text)."""
    if row.conversation_version is not None:
        return None
    try:
        head = row.context_head.decode() if row.context_head is not None else None
    except UnicodeDecodeError:
        return None
    return encode_fields(
        [
            row.id,
            row.owner,
            row.expires_ms,
            row.root_id,
            row.depth,
            row.chain_bytes,
            row.context_tokens,
            row.context_bytes,
            row.context_kept,
            row.context_head_id,
            head,
            row.context_runs.hex() if row.context_runs is not None else None,
        ]
    )


def decode_head(raw: bytes) -> ResponseRow | None:
    """The row kept; None for one this code cannot read. Its body is empty."""
    fields = decode_fields(raw, _ROW_WIDTH)
    if fields is None:
        return None
    try:
        (
            response_id,
            owner,
            expires_ms,
            root_id,
            depth,
            chain_bytes,
            tokens,
            counted,
            kept,
            head_id,
            head,
            runs,
        ) = fields
        row = ResponseRow(
            id=response_id,
            root_id=root_id,
            depth=depth,
            chain_bytes=chain_bytes,
            body=b"",
            conversation_version=None,
            context_tokens=tokens,
            context_bytes=counted,
            context_kept=kept,
            context_head_id=head_id,
            context_head=head.encode() if head is not None else None,
            context_runs=bytes.fromhex(runs) if runs is not None else None,
            expires_ms=expires_ms,
            owner=owner,
        )
    except (ValueError, TypeError, AttributeError):
        return None
    if not isinstance(expires_ms, int) or not isinstance(depth, int):
        return None
    return row


class ResponseHeads:
    """Rows under each response's cache entry (one hash tag). `keys(key)`: the entry's history, count and row keys;
    `decode(count, joined)`: the cache's reading of an entry. `read` raises the client's faults; the caller reads the
    database instead."""

    def __init__(
        self,
        client: RedisClient,
        keys: Callable[[CacheKey], tuple[str, str, str]],
        decode: Callable[[bytes, bytes], CachedHistory | None],
    ) -> None:
        self._client = client
        self._keys = keys
        self._decode = decode

    async def read(self, response_id: str, *, owner: str, now_ms: int) -> ChainHead:
        history, count, row = self._keys(response_key(response_id))
        joined, counted, stored = await self._client.execute("MGET", history, count, row)
        return self._served(response_id, owner, now_ms, (joined, counted, stored))

    async def read_held(self, response_id: str, context: bytes, *, owner: str, now_ms: int) -> ChainHead:
        """`read`, for a head whose context the reader holds already (a WebSocket connection, the chain's last
        response made there): the entry's count and row only, the history taken as `context`. A stored response
        never changes, so an entry still there under its id holds that very context; one dropped (a deletion, an
        erasure, the purger) or moved on (the chain continued from it elsewhere) is a miss, as `read`'s would be."""
        _, count, row = self._keys(response_key(response_id))
        counted, stored = await self._client.execute("MGET", count, row)
        return self._served(response_id, owner, now_ms, (context, counted, stored))

    def _served(self, response_id: str, owner: str, now_ms: int, values: tuple[object, object, object]) -> ChainHead:
        """What one read found: the entry's history, count and row, as Redis answered them."""
        joined, counted, stored = values
        cached = self._decode(counted, joined) if isinstance(joined, bytes) and isinstance(counted, bytes) else None
        if cached is None or not isinstance(stored, bytes):
            return ChainHead(row=None, cached=cached)
        head = decode_head(stored)
        if head is None:
            return ChainHead(row=None, cached=cached)
        if head.id != response_id or head.owner != owner or head.expires_ms <= now_ms or not cached_chain(head, cached):
            return ChainHead(row=None, cached=cached)
        return ChainHead(row=head, cached=cached)
