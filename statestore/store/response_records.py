"""What a Responses turn reads and writes: its items, a stored response, a new one, a conversation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import field
from typing import Literal

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
    # PROTOCOL §9 (responses/context.py ChainBase): what the backend counted of this turn, and where the context
    # the next turn starts from begins.
    context_tokens: int = 0
    context_bytes: int = 0
    context_kept: int | None = None
    context_head_id: str | None = None
    context_head: bytes | None = None
    # Where its chain's items lie (store/response_runs.py); None: the chain is walked.
    context_runs: bytes | None = None
    # Whose it is (the read names it): sealed content is bound to its owner (store/response_sealing.py).
    owner: str = ""


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
class ConversationRow:
    id: str
    metadata: bytes
    created_ms: int
