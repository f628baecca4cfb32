"""The Claude Messages API wire format, produced exactly: Message objects, their SSE event sequence, error bodies.

Pure functions shared by the echo backend and the test fake backend, so that both send the bytes the real API
sends and the official SDK accumulates a stream into the same Message the JSON path returns.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

JSONObject = dict[str, Any]

# The HTTP status the real API pairs with each error type (https://docs.claude.com/en/api/errors).
ERROR_STATUS: Mapping[str, int] = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "billing_error": 402,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "timeout_error": 504,
    "overloaded_error": 529,
}

SSE_CONTENT_TYPE = b"text/event-stream; charset=utf-8"
JSON_CONTENT_TYPE = b"application/json"

_BASE62 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_WORD = re.compile(r"\S+\s*")
# Blocks whose `input` the real API streams as input_json_delta; every other non-text block arrives whole.
_TOOL_INPUT_BLOCKS = frozenset({"tool_use", "server_tool_use", "mcp_tool_use"})
# Usage fields a message_delta repeats as cumulative totals (the SDK overwrites its snapshot with them).
_DELTA_USAGE_FIELDS = frozenset(
    {
        "input_tokens",
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
        "output_tokens",
        "server_tool_use",
        "output_tokens_details",
        "iterations",
        "fallback_credit",
    }
)
# Message fields that are only known at the end of a turn: null in message_start, given in message_delta.
_END_OF_TURN_FIELDS = ("stop_reason", "stop_sequence", "stop_details", "context_management")


def _base62(value: int, width: int) -> str:
    digits = []
    for _ in range(width):
        value, digit = divmod(value, 62)
        digits.append(_BASE62[digit])
    return "".join(reversed(digits))


def random_id(prefix: str) -> str:
    """An unguessable id shaped like the API's (`msg_01…`, `req_01…`, `toolu_01…`): 128 random bits in base62."""
    return f"{prefix}01{_base62(int.from_bytes(secrets.token_bytes(16)), 22)}"


def derived_id(prefix: str, seed: bytes) -> str:
    """An id shaped like `random_id` but fixed by `seed`, for replies that must be reproducible."""
    return f"{prefix}01{_base62(int.from_bytes(hashlib.sha256(seed).digest()[:16]), 22)}"


def new_message_id() -> str:
    return random_id("msg_")


def new_request_id() -> str:
    """A value for the `request-id` response header (and the `request_id` of error bodies)."""
    return random_id("req_")


def usage(
    input_tokens: int,
    output_tokens: int,
    *,
    cache_creation_input_tokens: int = 0,
    cache_read_input_tokens: int = 0,
) -> JSONObject:
    """The `usage` object in the field order the real API uses."""
    return {
        "input_tokens": input_tokens,
        "cache_creation_input_tokens": cache_creation_input_tokens,
        "cache_read_input_tokens": cache_read_input_tokens,
        "cache_creation": {"ephemeral_5m_input_tokens": cache_creation_input_tokens, "ephemeral_1h_input_tokens": 0},
        "output_tokens": output_tokens,
        "service_tier": "standard",
    }


def message(
    *,
    model: str,
    content: Sequence[Mapping[str, Any]],
    stop_reason: str | None,
    usage: Mapping[str, Any],
    stop_sequence: str | None = None,
    message_id: str | None = None,
) -> JSONObject:
    """A complete Message object, as the JSON body of a non-streaming reply."""
    return {
        "id": message_id if message_id is not None else new_message_id(),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [dict(block) for block in content],
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": dict(usage),
    }


def error_object(error_type: str, message: str, request_id: str) -> JSONObject:
    return {"type": "error", "error": {"type": error_type, "message": message}, "request_id": request_id}


def error_body(error_type: str, message: str, request_id: str) -> bytes:
    """The JSON body of an HTTP error response."""
    return orjson.dumps(error_object(error_type, message, request_id))


def sse_event(data: Mapping[str, Any]) -> bytes:
    """One SSE event; its name is the payload's `type`, as the real API does."""
    return b"event: " + str(data["type"]).encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def error_event(error_type: str, message: str, request_id: str) -> bytes:
    """The `error` event the real API sends when a stream fails after it started (e.g. overloaded)."""
    return sse_event(error_object(error_type, message, request_id))


PING_EVENT = sse_event({"type": "ping"})
MESSAGE_STOP_EVENT = sse_event({"type": "message_stop"})


def split_text(text: str, *, words_per_chunk: int = 4, max_chunks: int = 64) -> list[str]:
    """Cut text into delta-sized pieces of a few words (whitespace kept), so a stream has several events.

    Long texts get bigger pieces rather than thousands of events; the pieces always join back to `text`.
    """
    if not text:
        return []
    head = len(text) - len(text.lstrip())
    words = _WORD.findall(text, head)
    if not words:
        return [text]
    per_chunk = max(words_per_chunk, -(-len(words) // max_chunks))
    pieces = ["".join(words[i : i + per_chunk]) for i in range(0, len(words), per_chunk)]
    pieces[0] = text[:head] + pieces[0]
    return pieces


def split_json(encoded: str, *, max_chunks: int = 8) -> list[str]:
    """Cut serialised tool input into partial_json pieces.

    Cuts fall just after a `,` or `:`, never inside an escape sequence, so every prefix stays parseable by
    the SDK's partial JSON parser.
    """
    target = max(1, len(encoded) // max_chunks)
    pieces: list[str] = []
    start = 0
    for position, char in enumerate(encoded):
        if char in ",:" and position + 1 - start >= target:
            pieces.append(encoded[start : position + 1])
            start = position + 1
    if start < len(encoded):
        pieces.append(encoded[start:])
    return pieces


def _block_events(index: int, block: Mapping[str, Any]) -> list[bytes]:
    block_type = block.get("type")
    start: JSONObject = dict(block)
    deltas: list[JSONObject] = []
    if block_type == "text":
        start["text"] = ""
        citations = block.get("citations")
        if citations:
            start["citations"] = []
            deltas.extend({"type": "citations_delta", "citation": citation} for citation in citations)
        deltas.extend({"type": "text_delta", "text": piece} for piece in split_text(str(block.get("text", ""))))
    elif block_type == "thinking":
        start["thinking"] = ""
        start["signature"] = ""
        thinking = str(block.get("thinking", ""))
        deltas.extend({"type": "thinking_delta", "thinking": piece} for piece in split_text(thinking))
        deltas.append({"type": "signature_delta", "signature": block.get("signature", "")})
    elif block_type in _TOOL_INPUT_BLOCKS:
        tool_input = block.get("input") or {}
        start["input"] = {}
        # An empty input is one empty partial_json, as the real API sends it.
        pieces = split_json(orjson.dumps(tool_input).decode()) if tool_input else [""]
        deltas.extend({"type": "input_json_delta", "partial_json": piece} for piece in pieces)
    elif block_type == "compaction":
        start["content"] = None
        start["encrypted_content"] = None
        deltas.append(
            {
                "type": "compaction_delta",
                "content": block.get("content"),
                "encrypted_content": block.get("encrypted_content"),
            }
        )
    events = [sse_event({"type": "content_block_start", "index": index, "content_block": start})]
    events.extend(sse_event({"type": "content_block_delta", "index": index, "delta": delta}) for delta in deltas)
    events.append(sse_event({"type": "content_block_stop", "index": index}))
    return events


def message_events(message: Mapping[str, Any]) -> list[bytes]:
    """The SSE events the real API sends for `message`, in order, from message_start to message_stop.

    message_start carries every field of the message except content and the end-of-turn fields (so an SDK
    snapshot keeps fields that message_delta does not repeat); message_delta carries the end-of-turn fields and
    the cumulative usage.
    """
    full_usage: Mapping[str, Any] = message.get("usage") or {}
    output_tokens = full_usage.get("output_tokens", 0)
    start: JSONObject = {}
    for key, value in message.items():
        if key == "content":
            start[key] = []
        elif key in _END_OF_TURN_FIELDS:
            start[key] = None
        elif key == "usage":
            # The real API reports the first token or so here; the total comes in message_delta.
            start[key] = {**full_usage, "output_tokens": min(1, output_tokens)}
        else:
            start[key] = value
    events = [sse_event({"type": "message_start", "message": start}), PING_EVENT]
    for index, block in enumerate(message.get("content") or ()):
        events.extend(_block_events(index, block))
    delta: JSONObject = {"stop_reason": message.get("stop_reason"), "stop_sequence": message.get("stop_sequence")}
    for key in ("stop_details", "container"):
        if message.get(key) is not None:
            delta[key] = message[key]
    message_delta: JSONObject = {
        "type": "message_delta",
        "delta": delta,
        "usage": {key: value for key, value in full_usage.items() if key in _DELTA_USAGE_FIELDS}
        | {"output_tokens": output_tokens},
    }
    if message.get("context_management") is not None:
        message_delta["context_management"] = message["context_management"]
    events.append(sse_event(message_delta))
    events.append(MESSAGE_STOP_EVENT)
    return events
