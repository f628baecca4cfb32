"""A response made with `store: false` over a WebSocket, kept in that connection's memory only (docs/responses.md,
"WebSocket mode"): the row a continuation reads as its parent and the chain's context, as a stored response's would
be read, so `previous_response_id` continues it on that connection and nowhere else."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from statestore.responses.items import join_rendered, join_segments, stored
from statestore.responses.prepared import PreparedResponse
from statestore.store.response_records import ResponseRow


@dataclass(slots=True, frozen=True)
class KeptResponse:
    row: ResponseRow
    context: bytes  # the chain's messages up to and including this response, as chain_context joins them


def keep(prepared: PreparedResponse, response: dict[str, Any], body: bytes) -> KeptResponse:
    """The response a `store: false` turn completed, as its continuation will read it: what its commit would have
    stored of it, in memory."""
    outputs = [stored(item) for item in response["output"]]
    segment = join_rendered((i.kind, i.rendered) for i in [*prepared.inputs, *outputs])
    record = prepared.context_record(
        prepared.response_id,
        response.get("usage"),
        segment=segment,
        reply_bytes=len(join_rendered((i.kind, i.rendered) for i in outputs)),
    )
    parent = prepared.parent
    head = record.head
    if head is None and parent is not None and record.head_id == parent.context_head_id:
        head = parent.context_head  # a head made earlier in the chain, which its descendants name
    row = ResponseRow(
        id=prepared.response_id,
        root_id=parent.root_id if parent is not None else prepared.response_id,
        depth=parent.depth + 1 if parent is not None else 0,
        chain_bytes=(parent.chain_bytes if parent is not None else 0) + len(segment),
        body=body,
        conversation_version=None,
        context_tokens=record.tokens,
        context_bytes=record.counted_bytes,
        context_kept=record.kept,
        context_head_id=record.head_id,
        context_head=head,
        owner=prepared.principal.owner,
    )
    return KeptResponse(row, join_segments([prepared.context, segment]))
