"""What the Responses door seals at rest (encryption at rest, statestore/content_keys.py), and the associated data that
binds each sealed value to its row, so that a value copied to another row, position or owner does not open.

- responses: `body` (the Response JSON) and `context_head` (a compaction or summary head; `context_runs` holds only
  run keys and counts, no content, and stays clear), under ("r", owner, response id, column);
- response_items: `body` and `rendered` under ("ri", owner, response id, position, column);
- conversations: `metadata` under ("c", owner, conversation id, "metadata");
- conversation_items: `body` and `rendered` under ("ci", owner, conversation id, position, column); a turn's items
  are sealed at the position its lease read, which is the position its commit stores them at (a commit that lost its
  lease stores nothing);
- background_responses: `request`, `headers` and `body` under ("bg", owner, id, column).

Everything is sealed under the scope of the row that carries the owner (the response, the conversation, the background
turn): Scope(owner, tenant_id, metadata_user_id). A conversation turn's items are sealed under the turn's scope, the
one its responses row names, so erasing that user id makes them unreadable wherever they lie.

A store is given ContentKeys only when encryption is on (`active`): with it off the stores skip every step here on one
`is None` check."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from statestore.content_keys import ContentKeys, ContentSealer, Scope, row_data
from statestore.store.response_records import NewResponse, StoredItem


def active(content: ContentKeys | None) -> ContentKeys | None:
    """The keys a store seals with, or None when encryption is off (then nothing is sealed or opened)."""
    return content if content is not None and content.enabled else None


def response_data(owner: str, response_id: str, column: str) -> bytes:
    return row_data("r", owner, response_id, column)


def response_item_data(owner: str, response_id: str, position: int, column: str) -> bytes:
    return row_data("ri", owner, response_id, position, column)


def conversation_data(owner: str, conversation_id: str) -> bytes:
    return row_data("c", owner, conversation_id, "metadata")


def conversation_item_data(owner: str, conversation_id: str, position: int, column: str) -> bytes:
    return row_data("ci", owner, conversation_id, position, column)


def background_data(owner: str, response_id: str, column: str) -> bytes:
    return row_data("bg", owner, response_id, column)


def scope_of(new: NewResponse) -> Scope:
    return Scope(new.owner, new.tenant_id, new.metadata_user_id)


def seal_items(
    sealer: ContentSealer, items: Sequence[StoredItem], owner: str, holder: str, first: int, *, conversation: bool
) -> list[StoredItem]:
    """`items` with body and rendering sealed at positions `first`…, in response `holder`'s items or (conversation)
    conversation `holder`'s."""
    data = conversation_item_data if conversation else response_item_data
    return [
        StoredItem(
            item.item_id,
            sealer.seal(item.body, data(owner, holder, first + i, "body")),
            item.kind,
            sealer.seal(item.rendered, data(owner, holder, first + i, "rendered")),
        )
        for i, item in enumerate(items)
    ]


def seal_response(new: NewResponse, sealer: ContentSealer) -> NewResponse:
    """The turn to commit with its content sealed (the caller's objects are left as they are: its cache entry is made
    from them)."""
    owner = new.owner
    items = [*new.inputs, *new.outputs]
    if new.conversation_id is None:
        sealed = seal_items(sealer, items, owner, new.id, 0, conversation=False)
    else:
        if new.conversation_position is None:
            raise ValueError("a conversation turn to seal names the position its lease read")
        sealed = seal_items(sealer, items, owner, new.conversation_id, new.conversation_position, conversation=True)
    context = new.context
    if context.head is not None:
        # A head is stored on the response whose turn made it: this one.
        context = dataclasses.replace(context, head=sealer.seal(context.head, response_data(owner, new.id, "head")))
    return dataclasses.replace(
        new,
        body=sealer.seal(new.body, response_data(owner, new.id, "body")),
        inputs=sealed[: len(new.inputs)],
        outputs=sealed[len(new.inputs) :],
        context=context,
    )
