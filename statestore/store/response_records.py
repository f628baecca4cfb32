"""What a Responses turn reads and writes: its items, a stored response, a new one, a conversation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import field, fields
from typing import Any, Literal, Protocol

from statestore.records import record

# How an item's rendering joins a rebuild (responses/items.py): a whole chat message, one `tool_calls` entry of a
# function call, or nothing.
Kind = Literal["message", "call", "none"]


@record
class StoredItem:
    item_id: str
    body: bytes  # the item's Responses JSON
    kind: Kind
    rendered: bytes  # Chat Completions bytes (responses/items.py says which)


@record
class ResponseRow:
    id: str
    root_id: str
    depth: int
    chain_bytes: int
    body: bytes
    # The chain began on a conversation's response: that conversation's version (its next position, moved by every
    # change of its items; -1 once it is gone) as this row was read. None for a chain of its own.
    conversation_version: int | None = None
    # docs/protocol.md §9 (responses/context.py ChainBase): what the backend counted of this turn, and where the context
    # the next turn starts from begins.
    context_tokens: int = 0
    context_bytes: int = 0
    context_kept: int | None = None
    context_head_id: str | None = None
    context_head: bytes | None = None
    # Where its chain's items lie (store/response_runs.py); None: the chain is walked.
    context_runs: bytes | None = None
    expires_ms: int = 0
    # Whose it is (the read names it): sealed content is bound to its owner (store/response_sealing.py).
    owner: str = ""


class Columns(Protocol):
    """A read's row by its columns' names: an asyncpg Record, or a SQLAlchemy Row's `_mapping`."""

    def __getitem__(self, name: str, /) -> Any: ...


# What a read of a response selects, each column labelled as the field it fills (the owner is the read's own).
READ_COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(ResponseRow) if f.name != "owner")


def read_row(found: Columns, owner: str) -> ResponseRow:
    """The row a read found (store/response_statements.py GET_RESPONSE, run by asyncpg or by Core), taken by its
    columns' names: listing the columns in another order cannot swap two fields; a column left unlabelled fails."""
    return ResponseRow(**{name: found[name] for name in READ_COLUMNS}, owner=owner)


@record
class ContextRecord:
    """What a turn stores of its context (ResponseRow's context_* fields): a head is stored only on the response
    whose turn made it (head_id names that response, its own id included); its descendants name it."""

    tokens: int = 0
    counted_bytes: int = 0
    kept: int | None = None
    head_id: str | None = None
    head: bytes | None = None


@record
class NewResponse:
    id: str
    owner: str
    tenant_id: str | None
    metadata_user_id: str | None
    parent: ResponseRow | None
    conversation_id: str | None
    segment_bytes: int
    body: bytes
    created_ms: int
    expires_ms: int
    inputs: Sequence[StoredItem]
    outputs: Sequence[StoredItem]
    context: ContextRecord = field(default_factory=ContextRecord)
    # On a conversation: the position its lease read, where the commit stores its items (their sealing names it).
    conversation_position: int | None = None


@record
class Stored:
    """A turn as the database stored it: where its chain's items lie (ResponseRow.context_runs; None for a turn on a
    conversation, whose items are the conversation's)."""

    runs: bytes | None = None


def stored_row(new: NewResponse, stored: Stored) -> ResponseRow:
    """The row of a response just stored, as a read of it returns it (a continue's parent, store/response_heads.py).
    On a conversation its version is where the commit left the conversation."""
    parent = new.parent
    head_id, head = new.context.head_id, new.context.head
    if head is None and parent is not None and head_id is not None and head_id == parent.context_head_id:
        head = parent.context_head  # an ancestor's head, which a read joins from the response that holds it
    version = parent.conversation_version if parent is not None else None
    if new.conversation_position is not None:
        version = new.conversation_position + len(new.inputs) + len(new.outputs)
    return ResponseRow(
        id=new.id,
        root_id=parent.root_id if parent is not None else new.id,
        depth=parent.depth + 1 if parent is not None else 0,
        chain_bytes=(parent.chain_bytes if parent is not None else 0) + new.segment_bytes,
        body=new.body,
        conversation_version=version,
        context_tokens=new.context.tokens,
        context_bytes=new.context.counted_bytes,
        context_kept=new.context.kept,
        context_head_id=head_id,
        context_head=head,
        context_runs=stored.runs,
        expires_ms=new.expires_ms,
        owner=new.owner,
    )


@record
class ConversationRow:
    id: str
    metadata: bytes
    created_ms: int
