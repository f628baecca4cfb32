"""Responses items: a request's validated `input` normalised, and each item rendered once as the Chat Completions
bytes a rebuild joins.

A stored item is a pair (its Responses JSON, its rendering). The rendering is one of: a whole chat message; the
`tool_calls` entry of a function call (consecutive calls join one assistant message, so the join wraps them); or
nothing (reasoning, and a compaction a turn made, are stored and returned, never sent: the compaction's summary is in
the head its turn stored; an item of a kind statestore does not run, schemas.OPAQUE_ITEM_TYPES, has no form in Chat
Completions). An assistant message's `phase` is kept; it renders as any assistant message.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import orjson

from statestore.responses.ids import new_id
from statestore.responses.request_schemas import (
    AssistantMessageParam,
    CompactionItemParam,
    FunctionCallOutputParam,
    FunctionCallParam,
    InputImageParam,
    InputTextParam,
    ItemParam,
    MessageParam,
    RefusalParam,
    TurnItemParam,
)
from statestore.store.response_records import Kind, StoredItem


def _part(part: InputTextParam | InputImageParam | RefusalParam, assistant: bool) -> dict[str, Any]:
    if isinstance(part, InputImageParam):
        return {"type": "input_image", "image_url": part.image_url, "detail": part.detail}
    if isinstance(part, RefusalParam):
        return {"type": "refusal", "refusal": part.refusal}
    if assistant:
        return {"type": "output_text", "text": part.text, "annotations": [], "logprobs": []}
    return {"type": "input_text", "text": part.text}


def _parts(
    content: str | Sequence[InputTextParam | InputImageParam | RefusalParam], assistant: bool
) -> list[dict[str, Any]]:
    if isinstance(content, str):
        content = [InputTextParam(type="input_text", text=content)]
    return [_part(part, assistant) for part in content]


def _normalised(item: ItemParam | TurnItemParam) -> dict[str, Any]:
    """An item as stored and returned: its id minted when absent, its status filled in, its parts in the form its
    role's messages carry. An item of a kind statestore does not run is kept as it came."""
    if isinstance(item, dict):
        return item if item.get("id") is not None else {**item, "id": new_id("item_")}
    if isinstance(item, AssistantMessageParam):
        message = {
            "type": "message",
            "id": item.id or new_id("msg_"),
            "role": item.role,
            "content": _parts(item.content, True),
            "status": item.status or "completed",
        }
        if item.phase is not None:
            message["phase"] = item.phase
        return message
    if isinstance(item, MessageParam):
        return {
            "type": "message",
            "id": item.id or new_id("msg_"),
            "role": item.role,
            "content": _parts(item.content, False),
            "status": item.status or "completed",
        }
    if isinstance(item, FunctionCallParam):
        return {
            "type": "function_call",
            "id": item.id or new_id("fc_"),
            "call_id": item.call_id,
            "name": item.name,
            "arguments": item.arguments,
            "status": item.status or "completed",
        }
    if isinstance(item, FunctionCallOutputParam):
        output = item.output
        return {
            "type": "function_call_output",
            "id": item.id or new_id("fc_"),
            "call_id": item.call_id,
            "output": output if isinstance(output, str) else _parts(output, False),
            "status": item.status or "completed",
        }
    if isinstance(item, CompactionItemParam):
        # Rendered only once opened for its owner (responses/compaction.py); as an output item it renders nothing.
        compaction = {
            "type": "compaction",
            "id": item.id or new_id("cmp_"),
            "encrypted_content": item.encrypted_content,
        }
        if item.created_by is not None:  # a string when present (the SDK's and the specification's type)
            compaction["created_by"] = item.created_by
        return compaction
    out: dict[str, Any] = {"type": "reasoning", "id": item.id or new_id("rs_"), "summary": item.summary}
    if item.content is not None:
        out["content"] = item.content
    if item.encrypted_content is not None:
        out["encrypted_content"] = item.encrypted_content
    return out


def normalise_input(value: str | Sequence[ItemParam] | Sequence[TurnItemParam]) -> list[dict[str, Any]]:
    """A validated `input` (a user message's text, or items) as stored Responses items."""
    if isinstance(value, str):
        # The common turn, a user's text: the item _normalised would make, without building two models first.
        text = [{"type": "input_text", "text": value}]
        return [{"type": "message", "id": new_id("msg_"), "role": "user", "content": text, "status": "completed"}]
    return [_normalised(item) for item in value]


# -- rendering -------------------------------------------------------------------------------------------------------


def _chat_parts(parts: Sequence[dict[str, Any]]) -> str | list[dict[str, Any]]:
    if len(parts) == 1 and parts[0]["type"] == "input_text":
        return str(parts[0]["text"])
    out: list[dict[str, Any]] = []
    for part in parts:
        if part["type"] == "input_image":
            out.append({"type": "image_url", "image_url": {"url": part["image_url"], "detail": part["detail"]}})
        else:
            out.append({"type": "text", "text": part.get("text", "")})
    return out


def render(item: dict[str, Any]) -> tuple[Kind, bytes]:
    kind = item["type"]
    if kind == "message":
        if item["role"] == "assistant":
            text = "".join(p.get("text", "") for p in item["content"] if p["type"] == "output_text")
            refusal = "".join(p.get("refusal", "") for p in item["content"] if p["type"] == "refusal")
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if refusal:
                message["refusal"] = refusal
            return "message", orjson.dumps(message)
        return "message", orjson.dumps({"role": item["role"], "content": _chat_parts(item["content"])})
    if kind == "function_call":
        call = {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        return "call", orjson.dumps(call)
    if kind == "function_call_output":
        output = item["output"]
        content = output if isinstance(output, str) else "".join(p.get("text", "") for p in output)
        return "message", orjson.dumps({"role": "tool", "tool_call_id": item["call_id"], "content": content})
    return "none", b""


def stored(item: dict[str, Any]) -> StoredItem:
    kind, rendered = render(item)
    return StoredItem(item_id=str(item["id"]), body=orjson.dumps(item), kind=kind, rendered=rendered)


_CALLS_OPEN = b'{"role":"assistant","content":null,"tool_calls":['


def join_rendered(pieces: Iterable[tuple[str, bytes]]) -> bytes:
    """One segment's messages (the items of one response, or of one conversation), joined with commas: consecutive
    function calls become one assistant message. Only stored bytes are joined; nothing is parsed."""
    out: list[bytes] = []
    calls: list[bytes] = []
    for kind, rendered in pieces:
        if kind == "message":  # the common case first: a rebuild at depth joins thousands
            if calls:
                out.append(_CALLS_OPEN + b",".join(calls) + b"]}")
                calls = []
            out.append(rendered)
        elif kind == "call":
            calls.append(rendered)
        elif calls:
            out.append(_CALLS_OPEN + b",".join(calls) + b"]}")
            calls = []
    if calls:
        out.append(_CALLS_OPEN + b",".join(calls) + b"]}")
    return b",".join(out)


def join_segments(segments: Iterable[bytes]) -> bytes:
    return b",".join(segment for segment in segments if segment)
