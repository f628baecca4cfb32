"""The Responses front door's hot path on PostgreSQL, below SQLAlchemy: the statements every turn runs, as asyncpg
prepared statements on the pools of `pg_turns` (the same two: the conversation lease commits asynchronously, the turn
waits for its flush). SQLAlchemy Core keeps SQLite and every cold path (responses/store.py, conversation_store.py).

A turn's commit is one statement, one round trip, one durable flush: the response and its items; on a conversation,
the conditional move of its position (the lease's check), the response and the items, which are stored once, in
conversation_items, with the response pointing at them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from statestore.responses.items import StoredItem
from statestore.responses.records import ContextRecord
from statestore.store.pg_turns import PgTurnStatements

# With the version of the conversation its chain began on, if it did (-1: that conversation is gone): see
# responses/context.py chain_count.
GET_RESPONSE = """
SELECT r.id, r.root_id, r.depth, r.chain_bytes, r.body,
    CASE WHEN root.conversation_id IS NULL THEN NULL ELSE coalesce(c.next_position, -1) END,
    coalesce(r.context_tokens, 0), coalesce(r.context_bytes, 0), r.context_kept, r.context_head_id, holder.context_head
FROM responses r
LEFT JOIN responses root ON root.id = r.root_id
LEFT JOIN conversations c ON c.id = root.conversation_id
LEFT JOIN responses holder ON holder.id = r.context_head_id
WHERE r.id = $1 AND r.owner = $2 AND r.expires_ms > $3
"""

# A chained turn: the response, then its items (inputs first: position < $12 is an input); $17-$21 its context
# (ContextRecord).
INSERT_RESPONSE = """
WITH added AS (
    INSERT INTO responses (id, owner, tenant_id, metadata_user_id, parent_id, root_id, conversation_id, depth,
        chain_bytes, body, created_ms, expires_ms, context_tokens, context_bytes, context_kept, context_head_id,
        context_head)
    VALUES ($1, $2, $3, $4, $5, $6, NULL, $7, $8, $9, $10, $11, $17, $18, $19, $20, $21)
    RETURNING id
)
INSERT INTO response_items (response_id, position, is_output, item_id, body, kind, rendered)
SELECT added.id, (m.ord - 1)::integer, m.ord > $12, m.item_id, m.body, m.kind, m.rendered
FROM added, unnest($13::varchar[], $14::bytea[], $15::varchar[], $16::bytea[])
    WITH ORDINALITY AS m(item_id, body, kind, rendered, ord)
"""

# A turn on a conversation: nothing happens unless the turn still holds the lease ($6); then its items take the next
# positions and the response points at the first of them. Returns that position, or no row (the lease was lost).
COMMIT_CONVERSATION_TURN = """
WITH claimed AS (
    UPDATE conversations SET next_position = next_position + $11, lease_token = NULL, lease_expires_ms = NULL,
        expires_ms = $10, context_tokens = coalesce($17, context_tokens), context_bytes = coalesce($18, context_bytes)
    WHERE id = $5 AND lease_token = $6
    RETURNING next_position - $11 AS start
), added AS (
    INSERT INTO responses (id, owner, tenant_id, metadata_user_id, parent_id, root_id, conversation_id,
        conversation_position, input_count, output_count, depth, chain_bytes, body, created_ms, expires_ms,
        context_tokens, context_bytes)
    SELECT $1, $2, $3, $4, NULL, $1, $5, claimed.start, $12, $11 - $12, 0, $7, $8, $9, $10, $17, $18 FROM claimed
), items AS (
    INSERT INTO conversation_items (conversation_id, position, item_id, body, kind, rendered)
    SELECT $5, claimed.start + (m.ord - 1)::integer, m.item_id, m.body, m.kind, m.rendered
    FROM claimed, unnest($13::varchar[], $14::bytea[], $15::varchar[], $16::bytea[])
        WITH ORDINALITY AS m(item_id, body, kind, rendered, ord)
)
SELECT start FROM claimed
"""

LEASE_CONVERSATION = """
UPDATE conversations SET lease_token = $4, lease_expires_ms = $5
WHERE id = $1 AND owner = $2 AND expires_ms > $3 AND (lease_token IS NULL OR lease_expires_ms <= $3)
RETURNING next_position, coalesce(context_tokens, 0), coalesce(context_bytes, 0)
"""
RENEW_CONVERSATION = "UPDATE conversations SET lease_expires_ms = $3 WHERE id = $1 AND lease_token = $2"
RELEASE_CONVERSATION = (
    "UPDATE conversations SET lease_token = NULL, lease_expires_ms = NULL WHERE id = $1 AND lease_token = $2"
)
LOAD_CONVERSATION = "SELECT kind, rendered FROM conversation_items WHERE conversation_id = $1 ORDER BY position"

# A chain rebuilt from the database (responses/store.py chain_context says how it is read): every member once, ahead
# of its items, marked 'pointed' when its items are in its conversation.
CHAIN_CONTEXT = """
WITH RECURSIVE chain AS (
    SELECT id, parent_id, depth, conversation_position FROM responses WHERE id = $1
    UNION ALL
    SELECT r.id, r.parent_id, r.depth, r.conversation_position FROM responses r JOIN chain ON r.id = chain.parent_id
)
SELECT depth, kind, rendered FROM (
    SELECT depth, -1 AS position, CASE WHEN conversation_position IS NULL THEN 'none' ELSE 'pointed' END AS kind,
        ''::bytea AS rendered
    FROM chain
    UNION ALL
    SELECT chain.depth, i.position, i.kind, i.rendered FROM chain JOIN response_items i ON i.response_id = chain.id
) AS members
ORDER BY depth, position
"""
# The items a response made on a conversation points at there.
POINTED_ITEMS = """
SELECT i.kind, i.rendered FROM responses r JOIN conversation_items i
    ON i.conversation_id = r.conversation_id AND i.position >= r.conversation_position
    AND i.position < r.conversation_position + r.input_count + r.output_count
WHERE r.id = $1
ORDER BY i.position
"""


def item_arrays(items: Sequence[StoredItem]) -> tuple[list[str], list[bytes], list[str], list[bytes]]:
    return (
        [i.item_id for i in items],
        [i.body for i in items],
        [i.kind for i in items],
        [i.rendered for i in items],
    )


class PgResponseStatements:
    def __init__(self, pg: PgTurnStatements) -> None:
        self._pg = pg

    async def get(self, owner: str, response_id: str, now_ms: int) -> Any:
        async with self._pg.durable_connection() as conn:
            return await conn.fetchrow(GET_RESPONSE, response_id, owner, now_ms)

    async def insert_response(
        self, *args: Any, inputs: int, items: Sequence[StoredItem], context: ContextRecord
    ) -> None:
        """(id, owner, tenant, user id, parent id, root id, depth, chain bytes, body, created, expires)."""
        async with self._pg.durable_connection() as conn:
            await conn.execute(
                INSERT_RESPONSE,
                *args,
                inputs,
                *item_arrays(items),
                context.tokens or None,
                context.counted_bytes or None,
                context.kept,
                context.head_id,
                context.head,
            )

    async def commit_conversation_turn(
        self, *args: Any, inputs: int, items: Sequence[StoredItem], context: ContextRecord
    ) -> int | None:
        """(id, owner, tenant, user id, conversation, lease token, chain bytes, body, created, expires) → the turn's
        first position in the conversation, or None when the lease was lost (nothing stored). A conversation's turn
        stores what it measured; its context is the conversation's items, every turn (responses/context.py)."""
        async with self._pg.durable_connection() as conn:
            start: int | None = await conn.fetchval(
                COMMIT_CONVERSATION_TURN,
                *args,
                len(items),
                inputs,
                *item_arrays(items),
                context.tokens or None,
                context.counted_bytes or None,
            )
        return start

    async def lease(
        self, owner: str, conversation_id: str, token: str, now_ms: int, until_ms: int
    ) -> tuple[int, int, int] | None:
        """The conversation's next position and its last turn's measure (tokens, bytes), taken for one turn; None
        when it is not free (or not there)."""
        async with self._pg.lease_connection() as conn:
            row = await conn.fetchrow(LEASE_CONVERSATION, conversation_id, owner, now_ms, token, until_ms)
        return None if row is None else (int(row[0]), int(row[1]), int(row[2]))

    async def renew(self, conversation_id: str, token: str, until_ms: int) -> bool:
        async with self._pg.lease_connection() as conn:
            status: str = await conn.execute(RENEW_CONVERSATION, conversation_id, token, until_ms)
        return status == "UPDATE 1"

    async def release(self, conversation_id: str, token: str) -> None:
        async with self._pg.lease_connection() as conn:
            await conn.execute(RELEASE_CONVERSATION, conversation_id, token)

    async def chain_rows(self, head_id: str) -> list[Any]:
        """(depth, kind, rendered) of the chain ending at `head_id`, as CHAIN_CONTEXT orders them."""
        async with self._pg.durable_connection() as conn:
            return list(await conn.fetch(CHAIN_CONTEXT, head_id))

    async def pointed_items(self, response_id: str) -> list[tuple[str, bytes]]:
        async with self._pg.durable_connection() as conn:
            rows = await conn.fetch(POINTED_ITEMS, response_id)
        return [(row[0], row[1]) for row in rows]

    async def conversation_items(self, conversation_id: str) -> list[tuple[str, bytes]]:
        async with self._pg.durable_connection() as conn:
            rows = await conn.fetch(LOAD_CONVERSATION, conversation_id)
        return [(row[0], row[1]) for row in rows]
