"""The echo backend: a tiny, fast, deterministic stand-in for a Messages API backend (local trial, benchmarks, tests).

Raw ASGI on uvicorn (uvloop and httptools when installed); `statestore echo-backend --port N` runs it.

Routes
    POST /v1/messages               a reply derived from the request, as JSON or, with `"stream": true`, as SSE
    POST /v1/messages/count_tokens  {"input_tokens": N}, the same estimate as a reply's usage.input_tokens
    POST /v1/chat/completions       a Chat Completions reply, JSON or SSE (statestore/upstream/echo_chat.py)
    GET  /v1/models[/{id}]          one model, `echo-1`; any other id is 404 not_found_error
    anything else                   404 not_found_error
Every response, errors included, has a `request-id` header; errors have the API's error body.

The reply, for a request whose `messages` end with a user turn:
  * text `"echo: <the turn's text>"` (its text blocks joined with newlines); a turn without text is described,
    e.g. `"echo: (3 tool results)"`; when the conversation ends with an assistant turn (a prefill, or a
    continuation after `pause_turn`) the text is `"echo: (continuing)"`. `role: "system"` entries are skipped.
  * thinking: when `thinking.type` is `enabled` or `adaptive`, a `thinking` block comes first, with a
    deterministic text (empty when `display` is `omitted`) and a deterministic `signature`.
  * tool_use trigger: when the request has client `tools` and the turn's text contains `call <tool_name>` for
    one of them (the first such mention wins), or `tool_choice` is `{"type": "tool", "name": ...}` (that tool)
    or `{"type": "any"}` (the mentioned tool, else the first tool), the text block is followed by a `tool_use`
    block for that tool and `stop_reason` is `tool_use`. Its input fills each required property of the input
    schema (or, when none is required, the first string property): strings get the turn's text, numbers 1,
    booleans true, arrays [], objects {}, enums their first value. Its id is derived from the request's
    messages, so the same request gets the same id. `tool_choice: {"type": "none"}` never calls a tool.
  * `stop_sequences`: the text is cut before the earliest occurrence of any of them, `stop_reason`
    `stop_sequence`. `max_tokens`: the output is cut to fit the token estimate below, `stop_reason`
    `max_tokens` (a tool call that does not fit is dropped). Empty text blocks are left out, as the API does.

Token counts are an honest, documented estimate: one token per 4 bytes, rounded up. input_tokens counts the
compact JSON (orjson) of the request's `system`, `tools` and `messages` (from the last compaction block on, which
the API reads instead of what came before); output_tokens counts the UTF-8 bytes of the thinking text, the reply
text and the tool input JSON (at least 1).

Context window (echo_context.py): with `context_window` (`--context-window`, STATESTORE_ECHO_CONTEXT_WINDOW) a
request of more input tokens is refused with the API's 400 "prompt is too long: N tokens > W maximum"; a
`compact_20260112` context-management edit whose trigger the request reaches opens the reply with a deterministic
`compaction` block.

Benchmark knobs: `delay_seconds` is slept before a JSON reply, and spread evenly before the events of a
stream; `reply_bytes` pads the reply text with filler words to about that many bytes.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from statestore.upstream import echo_chat, echo_context, wire
from statestore.upstream.echo_asgi import (
    MAX_BODY_BYTES,
    lifespan,
    parse_request,
    read_body,
    send_error,
    send_json,
    send_sse_start,
    serve_asgi,
)

# The ASGI plumbing is re-exported: the fake backend of the tests and the bench reach it through this module.
__all__ = ["MAX_BODY_BYTES", "parse_request", "read_body", "send_error", "send_json", "send_sse_start", "serve_asgi"]

MODEL_ID = "echo-1"
MODEL_INFO: wire.JSONObject = {
    "type": "model",
    "id": MODEL_ID,
    "display_name": "Echo",
    "created_at": "2026-01-01T00:00:00Z",
    "lifecycle": "active",
}

_CALL = re.compile(r"\bcall ([A-Za-z0-9_-]{1,128})")
_FILLER = " lorem ipsum dolor sit amet"
_SCHEMA_DEFAULTS: Mapping[str, Any] = {"integer": 1, "number": 1, "boolean": True, "array": [], "object": {}}


def estimate_tokens(n_bytes: int) -> int:
    return -(-n_bytes // 4)


def estimate_input_tokens(request: Mapping[str, Any]) -> int:
    return echo_context.input_tokens(request)


def validate_messages_request(request: object) -> str | None:
    """The message of the 400 the real API would send for this body, or None. Checks only what the reply needs."""
    if not isinstance(request, dict):
        return "Request body must be a JSON object"
    for field in ("model", "max_tokens", "messages"):
        if field not in request:
            return f"{field}: Field required"
    if not isinstance(request["model"], str) or not request["model"]:
        return "model: Input should be a non-empty string"
    max_tokens = request["max_tokens"]
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        return "max_tokens: Input should be an integer greater than or equal to 1"
    messages = request["messages"]
    if not isinstance(messages, list):
        return "messages: Input should be a valid list"
    if not messages:
        return "messages: at least one message is required"
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant", "system"):
            return f"messages.{index}.role: Input should be 'user' or 'assistant'"
        if not isinstance(message.get("content"), str | list):
            return f"messages.{index}.content: Field required"
    for field in ("tools", "stop_sequences"):
        if field in request and not isinstance(request[field], list):
            return f"{field}: Input should be a valid list"
    if "stream" in request and not isinstance(request["stream"], bool):
        return "stream: Input should be a valid boolean"
    return None


def _describe(blocks: Sequence[Any]) -> str:
    counts: dict[str, int] = {}
    for block in blocks:
        block_type = block.get("type") if isinstance(block, dict) else None
        name = "tool result" if block_type == "tool_result" else str(block_type or "unknown").replace("_", " ")
        counts[name] = counts.get(name, 0) + 1
    if not counts:
        return "(empty turn)"
    return "(" + ", ".join(f"{n} {name}{'s' if n > 1 else ''}" for name, n in counts.items()) + ")"


def turn_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """What the echo answers to: the text of the conversation's final user turn, or a description of it."""
    for message in reversed(messages):
        role = message.get("role")
        if role == "system":
            continue
        if role != "user":
            return "(continuing)"
        content = message.get("content")
        if isinstance(content, str):
            return content
        blocks = content if isinstance(content, list) else []
        texts = [b["text"] for b in blocks if isinstance(b, dict) and b.get("type") == "text" and "text" in b]
        return "\n".join(str(text) for text in texts) if texts else _describe(blocks)
    return "(no user turn)"


def _called_tool(request: Mapping[str, Any], text: str) -> Mapping[str, Any] | None:
    # Server tools (`type` like web_search_20250305) are the backend's to run, never a client tool_use.
    tools = [
        tool
        for tool in request.get("tools") or ()
        if isinstance(tool, dict) and isinstance(tool.get("name"), str) and tool.get("type") in (None, "custom")
    ]
    choice = request.get("tool_choice")
    choice_type = choice.get("type") if isinstance(choice, dict) else None
    if not tools or choice_type == "none":
        return None
    by_name = {tool["name"]: tool for tool in tools}
    if choice_type == "tool" and isinstance(choice, dict):
        return by_name.get(choice.get("name"))
    for match in _CALL.finditer(text):
        if match.group(1) in by_name:
            return by_name[match.group(1)]
    return tools[0] if choice_type == "any" else None


def _tool_input(tool: Mapping[str, Any], text: str) -> wire.JSONObject:
    schema = tool.get("input_schema")
    properties = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(properties, dict):
        return {}
    required = schema.get("required") if isinstance(schema, dict) else None
    names = [name for name in required or () if name in properties]
    if not names:
        names = [name for name, spec in properties.items() if isinstance(spec, dict) and spec.get("type") == "string"]
        names = names[:1]
    tool_input: wire.JSONObject = {}
    for name in names:
        spec = properties[name] if isinstance(properties[name], dict) else {}
        enum = spec.get("enum")
        if isinstance(enum, list) and enum:
            tool_input[name] = enum[0]
        else:
            tool_input[name] = _SCHEMA_DEFAULTS.get(str(spec.get("type")), text)
    return tool_input


def _thinking_block(request: Mapping[str, Any], text: str) -> wire.JSONObject | None:
    config = request.get("thinking")
    if not isinstance(config, dict) or config.get("type") not in ("enabled", "adaptive"):
        return None
    thinking = "" if config.get("display") == "omitted" else f"The user turn has {len(text)} characters; echo it."
    digest = hashlib.sha256(b"echo-thinking\0" + text.encode() + b"\0" + thinking.encode()).digest()
    return {"type": "thinking", "thinking": thinking, "signature": base64.b64encode(digest).decode()}


def _pad(text: str, reply_bytes: int | None) -> str:
    missing = (reply_bytes or 0) - len(text.encode())
    if missing <= 0:
        return text
    return text + (_FILLER * (missing // len(_FILLER) + 1))[:missing]


def _cut_to_bytes(text: str, budget: int) -> str:
    return text.encode()[: max(budget, 0)].decode(errors="ignore")


def echo_reply(request: Mapping[str, Any], *, reply_bytes: int | None = None) -> wire.JSONObject:
    """The Message the echo backend answers a valid Messages request with (see the module docstring)."""
    messages: Sequence[Mapping[str, Any]] = request["messages"]
    said = turn_text(messages)
    text = _pad("echo: " + said, reply_bytes)
    budget = int(request["max_tokens"]) * 4
    content: list[wire.JSONObject] = []
    compaction = echo_context.compaction_block(request)
    if compaction is not None:
        content.append(compaction)

    thinking = _thinking_block(request, said)
    if thinking is not None:
        content.append(thinking)
        budget -= len(thinking["thinking"].encode())

    stop_reason = "end_turn"
    stop_sequence: str | None = None
    cuts = [(text.find(s), s) for s in request.get("stop_sequences") or () if isinstance(s, str) and s and s in text]
    if cuts:
        position, sequence = min(cuts)
        if len(text[: position + len(sequence)].encode()) <= budget:
            text, stop_reason, stop_sequence = text[:position], "stop_sequence", sequence
    if len(text.encode()) > budget:
        text, stop_reason = _cut_to_bytes(text, budget), "max_tokens"
    if text:
        content.append({"type": "text", "text": text})
    budget -= len(text.encode())

    tool = _called_tool(request, said) if stop_reason == "end_turn" else None
    if tool is not None:
        tool_input = _tool_input(tool, said)
        if len(orjson.dumps(tool_input)) <= budget:
            tool_id = wire.derived_id("toolu_", orjson.dumps(messages))
            content.append({"type": "tool_use", "id": tool_id, "name": tool["name"], "input": tool_input})
            stop_reason = "tool_use"
        else:
            stop_reason = "max_tokens"

    output_bytes = sum(
        len(orjson.dumps(block["input"])) if block["type"] == "tool_use" else len(block[block["type"]].encode())
        for block in content
        if block["type"] != "compaction"
    )
    return wire.message(
        model=str(request["model"]),
        content=content,
        stop_reason=stop_reason,
        stop_sequence=stop_sequence,
        usage=wire.usage(estimate_input_tokens(request), max(1, estimate_tokens(output_bytes))),
    )


class EchoApp:
    def __init__(
        self, *, delay_seconds: float = 0.0, reply_bytes: int | None = None, context_window: int | None = None
    ) -> None:
        self.delay_seconds = delay_seconds
        self.reply_bytes = reply_bytes
        self.context_window = context_window

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        request_id = wire.new_request_id()
        method, path = scope["method"], scope["path"]
        if method == "POST" and path == "/v1/messages":
            await self._messages(receive, send, request_id)
        elif method == "POST" and path == "/v1/messages/count_tokens":
            await self._count_tokens(receive, send, request_id)
        elif method == "POST" and path == echo_chat.PATH:
            await self._chat(receive, send, request_id)
        elif method == "GET" and path == "/v1/models":
            page = {"data": [MODEL_INFO], "has_more": False, "first_id": MODEL_ID, "last_id": MODEL_ID}
            await send_json(send, 200, orjson.dumps(page), request_id)
        elif method == "GET" and path == f"/v1/models/{MODEL_ID}":
            await send_json(send, 200, orjson.dumps(MODEL_INFO), request_id)
        elif method == "GET" and path.startswith("/v1/models/"):
            await send_error(send, "not_found_error", f"model: {path.removeprefix('/v1/models/')}", request_id)
        else:
            await send_error(send, "not_found_error", f"Not found: {method} {path}", request_id)

    async def _messages(self, receive: Receive, send: Send, request_id: str) -> None:
        request = await parse_request(receive, send, request_id)
        if request is None:
            return
        problem = validate_messages_request(request) or echo_context.too_long(request, self.context_window)
        if problem is not None:
            await send_error(send, "invalid_request_error", problem, request_id)
            return
        reply = echo_reply(request, reply_bytes=self.reply_bytes)
        if request.get("stream") is True:
            await self._stream(send, wire.message_events(reply), request_id)
            return
        if self.delay_seconds:
            await asyncio.sleep(self.delay_seconds)
        await send_json(send, 200, orjson.dumps(reply), request_id)

    async def _stream(self, send: Send, events: Sequence[bytes], request_id: str) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        await send_sse_start(send, request_id)
        for index, event in enumerate(events, 1):
            if self.delay_seconds:
                # Paced against the start, so timer rounding does not add up over many short sleeps.
                await asyncio.sleep(max(0.0, started + self.delay_seconds * index / len(events) - loop.time()))
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _chat(self, receive: Receive, send: Send, request_id: str) -> None:
        body = await read_body(receive)
        try:
            request = orjson.loads(body) if body is not None else None
        except orjson.JSONDecodeError:
            request = None
        problem = "the body must be a JSON object" if not isinstance(request, dict) else None
        problem = problem or echo_chat.validate_chat_request(request)  # type: ignore[arg-type]
        if problem is not None:
            await send_json(send, 400, echo_chat.chat_error_body(problem), request_id)
            return
        assert isinstance(request, dict)
        reply = echo_chat.chat_reply(request)
        if request.get("stream") is True:
            include_usage = bool((request.get("stream_options") or {}).get("include_usage"))
            await self._stream(send, echo_chat.chunk_events(reply, include_usage=include_usage), request_id)
            return
        if self.delay_seconds:
            await asyncio.sleep(self.delay_seconds)
        await send_json(send, 200, orjson.dumps(reply), request_id)

    async def _count_tokens(self, receive: Receive, send: Send, request_id: str) -> None:
        request = await parse_request(receive, send, request_id)
        if request is None:
            return
        if not isinstance(request.get("messages"), list):
            await send_error(send, "invalid_request_error", "messages: Field required", request_id)
            return
        body = orjson.dumps({"input_tokens": estimate_input_tokens(request)})
        await send_json(send, 200, body, request_id)


def create_echo_app(
    *, delay_seconds: float = 0.0, reply_bytes: int | None = None, context_window: int | None = None
) -> ASGIApp:
    return EchoApp(delay_seconds=delay_seconds, reply_bytes=reply_bytes, context_window=context_window)


def run_echo_backend(
    host: str,
    port: int,
    *,
    delay_seconds: float = 0.0,
    reply_bytes: int | None = None,
    context_window: int | None = None,
    log_level: str = "warning",
) -> None:
    serve_asgi(
        create_echo_app(delay_seconds=delay_seconds, reply_bytes=reply_bytes, context_window=context_window),
        host=host,
        port=port,
        log_level=log_level,
    )
