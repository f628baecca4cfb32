"""`POST /v1/responses/compact` apart from HTTP (docs/responses.md, "Compaction"): the context a turn would send (the
chain of `previous_response_id` from where its last compaction left it, then `input`) summarised by the backend into
one compaction item after every user message of it. Nothing is stored."""

from __future__ import annotations

import time
from typing import Any

import orjson

from statestore.auth import Principal
from statestore.responses import context
from statestore.responses.backend import call_backend
from statestore.responses.chat_format import split, summary_text
from statestore.responses.compaction import compaction_item, user_item, user_messages
from statestore.responses.compaction_seal import CompactionSeal
from statestore.responses.errors import BackendError
from statestore.responses.items import join_rendered
from statestore.responses.prepared import PreparedResponse
from statestore.responses.reply import usage_of
from statestore.upstream.client import Upstream

# max_tokens of the summary when no window bounds it: a summary is a page, not a transcript.
SUMMARY_MAX_TOKENS = 4096


async def compacted(
    prepared: PreparedResponse,
    upstream: Upstream,
    headers: list[tuple[bytes, bytes]],
    principal: Principal,
    seal: CompactionSeal,
) -> dict[str, Any]:
    """The `response.compaction` object; the backend's error, relayed, when the summary request fails."""
    base = prepared.base
    new = join_rendered((i.kind, i.rendered) for i in prepared.inputs)
    messages = (split(base.head) if base.head else []) + split(base.context) + split(new)
    policy = prepared.policy
    body = context.summary_body(
        prepared.turn.chat_params,
        prepared.system_message(),
        model=(policy.summary_model if policy else None) or prepared.turn.model,
        max_tokens=SUMMARY_MAX_TOKENS,
        summarised=messages,
        instructions=policy.summary_instructions if policy else None,
    )
    response = await call_backend(upstream, headers, principal, body)
    try:
        raw = await response.read()
    finally:
        await response.aclose()
    try:
        reply = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise BackendError("the model backend's reply is not JSON") from None
    summary = summary_text(reply)
    if summary is None:
        raise BackendError("the model backend's summary has no text")
    output = [user_item(m) for m in user_messages(messages)]
    output.append(compaction_item(seal, summary, principal.owner))
    return {
        "id": prepared.response_id,
        "object": "response.compaction",
        "created_at": int(time.time()),
        "output": output,
        "usage": usage_of(reply.get("usage") if isinstance(reply, dict) else None),
    }
