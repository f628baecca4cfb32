"""Responses items: a request's `input` checked and normalised, and each item rendered once as the Chat Completions
bytes a rebuild joins.

A stored item is a pair (its Responses JSON, its rendering). The rendering is one of: a whole chat message; the
`tool_calls` entry of a function call (consecutive calls join one assistant message, so the join wraps them); or
nothing (reasoning is stored and returned, never sent).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import orjson

from statestore.responses.errors import BadRequest
from statestore.responses.ids import new_id
from statestore.store.response_records import Kind, StoredItem

_ROLES = frozenset({"user", "system", "developer", "assistant"})
_ITEM_STATUSES = frozenset({"in_progress", "completed", "incomplete"})
MAX_TEXT_CHARS = 10 * 1024 * 1024


def _bad(message: str, param: str) -> BadRequest:
    return BadRequest(message, param=param, code="invalid_value")


def _text(value: object, param: str) -> str:
    if not isinstance(value, str):
        raise _bad(f"Invalid type for '{param}': expected a string.", param)
    if len(value) > MAX_TEXT_CHARS:
        raise _bad(f"'{param}' is longer than {MAX_TEXT_CHARS} characters.", param)
    return value


def _optional_id(item: dict[str, Any], prefix: str, param: str) -> str:
    given = item.get("id")
    if given is None:
        return new_id(prefix)
    text = _text(given, f"{param}.id")
    if not 1 <= len(text) <= 200:
        raise _bad(f"Invalid '{param}.id': between 1 and 200 characters expected.", f"{param}.id")
    return text


def _status(item: dict[str, Any], param: str) -> str:
    status = item.get("status", "completed")
    if status not in _ITEM_STATUSES:
        raise _bad(f"Invalid value for '{param}.status'.", f"{param}.status")
    return str(status)


def _content_part(part: object, role: str, param: str) -> dict[str, Any]:
    if not isinstance(part, dict):
        raise _bad(f"Invalid type for '{param}': expected an object.", param)
    kind = part.get("type")
    if kind in ("input_text", "output_text", "text"):
        text = _text(part.get("text"), f"{param}.text")
        if role == "assistant":
            return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {"type": "input_text", "text": text}
    if kind == "refusal" and role == "assistant":
        return {"type": "refusal", "refusal": _text(part.get("refusal"), f"{param}.refusal")}
    if kind == "input_image" and role != "assistant":
        url = part.get("image_url")
        if url is None:
            raise _bad(f"Missing required parameter: '{param}.image_url' (file_id is not supported here).", param)
        detail = part.get("detail", "auto")
        if detail not in ("auto", "low", "high"):
            raise _bad(f"Invalid value for '{param}.detail'.", f"{param}.detail")
        return {"type": "input_image", "image_url": _text(url, f"{param}.image_url"), "detail": detail}
    raise _bad(f"Invalid value for '{param}.type': '{str(kind)[:50]}' is not supported in a {role} message.", param)


def _message(item: dict[str, Any], param: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise _bad(f"Invalid value for '{param}.role'.", f"{param}.role")
    content = item.get("content")
    if isinstance(content, str):
        parts = [_content_part({"type": "input_text", "text": content}, role, f"{param}.content")]
    elif isinstance(content, list) and content:
        parts = [_content_part(part, role, f"{param}.content[{i}]") for i, part in enumerate(content)]
    else:
        raise _bad(f"Invalid '{param}.content': a string or a non-empty array of parts expected.", f"{param}.content")
    return {
        "type": "message",
        "id": _optional_id(item, "msg_", param),
        "role": role,
        "content": parts,
        "status": _status(item, param),
    }


def _function_call(item: dict[str, Any], param: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": _optional_id(item, "fc_", param),
        "call_id": _text(item.get("call_id"), f"{param}.call_id"),
        "name": _text(item.get("name"), f"{param}.name"),
        "arguments": _text(item.get("arguments"), f"{param}.arguments"),
        "status": _status(item, param),
    }


def _function_output(item: dict[str, Any], param: str) -> dict[str, Any]:
    output = item.get("output")
    if isinstance(output, list):
        output = [_content_part(part, "user", f"{param}.output[{i}]") for i, part in enumerate(output)]
    else:
        output = _text(output, f"{param}.output")
    return {
        "type": "function_call_output",
        "id": _optional_id(item, "fc_", param),
        "call_id": _text(item.get("call_id"), f"{param}.call_id"),
        "output": output,
        "status": _status(item, param),
    }


def _reasoning(item: dict[str, Any], param: str) -> dict[str, Any]:
    summary = item.get("summary", [])
    if not isinstance(summary, list):
        raise _bad(f"Invalid type for '{param}.summary'.", f"{param}.summary")
    out: dict[str, Any] = {"type": "reasoning", "id": _optional_id(item, "rs_", param), "summary": summary}
    for key in ("content", "encrypted_content"):
        if item.get(key) is not None:
            out[key] = item[key]
    return out


def normalise_input(value: object, param: str = "input") -> list[dict[str, Any]]:
    """`input` (a string or a list of items) as normalised Responses items, or a 400 naming the bad field."""
    if isinstance(value, str):
        return [_message({"role": "user", "content": _text(value, param)}, param)]
    if not isinstance(value, list):
        raise _bad(f"Invalid type for '{param}': a string or an array of items expected.", param)
    items = []
    for i, raw in enumerate(value):
        where = f"{param}[{i}]"
        if not isinstance(raw, dict):
            raise _bad(f"Invalid type for '{where}': expected an object.", where)
        kind = raw.get("type", "message" if "role" in raw else None)
        if kind == "message":
            items.append(_message(raw, where))
        elif kind == "function_call":
            items.append(_function_call(raw, where))
        elif kind == "function_call_output":
            items.append(_function_output(raw, where))
        elif kind == "reasoning":
            items.append(_reasoning(raw, where))
        else:
            raise _bad(f"Invalid value for '{where}.type': '{str(kind)[:50]}' is not a supported item type.", where)
    return items


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
        if kind == "call":
            calls.append(rendered)
            continue
        if calls:
            out.append(_CALLS_OPEN + b",".join(calls) + b"]}")
            calls = []
        if kind == "message":
            out.append(rendered)
    if calls:
        out.append(_CALLS_OPEN + b",".join(calls) + b"]}")
    return b",".join(out)


def join_segments(segments: Iterable[bytes]) -> bytes:
    return b",".join(segment for segment in segments if segment)
