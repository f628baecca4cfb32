"""The echo backend's Chat Completions endpoint (`POST /v1/chat/completions`), so `make run` serves both front doors.

Strict about the request (a test backend that accepts anything proves nothing): `model`, `messages` with known
roles and fields, function `tools` only. The reply:
  * text `"echo: <the last user or tool message's text>"`;
  * a tool call when the request has `tools` and that text contains `call <tool_name>`, or `tool_choice` names a
    function (or is "required": the mentioned tool, else the first): `finish_reason: "tool_calls"`, arguments
    filling the required string properties with the text (numbers 1, booleans true), and an id derived from the
    request's messages;
  * `max_tokens` (or `max_completion_tokens`) cuts the text to fit, `finish_reason: "length"`.
Usage is the same documented estimate as the Messages endpoint: one token per 4 bytes of the compact JSON of
`messages` and `tools` in, of the reply text and arguments out. `stream: true` sends `chat.completion.chunk`s, then a
usage chunk when `stream_options.include_usage` is set, then `data: [DONE]`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from statestore.upstream import wire

PATH = "/v1/chat/completions"
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_FIELDS = frozenset(
    {
        "model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature",
        "top_p", "tools", "tool_choice", "parallel_tool_calls", "response_format", "user", "metadata", "stop", "n",
        "seed", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
    }
)  # fmt: skip
_CALL = re.compile(r"\bcall ([A-Za-z0-9_-]{1,128})")


def _estimate(n_bytes: int) -> int:
    return (n_bytes + 3) // 4


def _text_of(content: object) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [part.get("text") for part in content if isinstance(part, dict) and part.get("type") == "text"]
        return "\n".join(t for t in texts if isinstance(t, str))
    return None


def _check_message(message: object, i: int) -> str | None:
    if not isinstance(message, dict):
        return f"messages[{i}] must be an object"
    role = message.get("role")
    if role not in _ROLES:
        return f"messages[{i}].role must be one of {sorted(_ROLES)}"
    allowed = {"role", "content", "name"} | (
        {"tool_calls", "refusal"} if role == "assistant" else {"tool_call_id"} if role == "tool" else set()
    )
    extra = set(message) - allowed
    if extra:
        return f"messages[{i}] has unknown field {sorted(extra)[0]!r}"
    content = message.get("content")
    if role == "assistant" and content is None:
        if not message.get("tool_calls"):
            return f"messages[{i}]: an assistant message needs content or tool_calls"
    elif _text_of(content) is None:
        return f"messages[{i}].content must be a string or an array of parts"
    if isinstance(content, list):
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", "image_url"):
                return f"messages[{i}].content has an unknown part type {kind!r}"
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(function, dict)
            or call.get("type") != "function"
            or not isinstance(call.get("id"), str)
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), str)
        ):
            return f"messages[{i}].tool_calls has a malformed call"
    if role == "tool" and not isinstance(message.get("tool_call_id"), str):
        return f"messages[{i}].tool_call_id is required"
    return None


def validate_chat_request(request: Mapping[str, Any]) -> str | None:
    extra = set(request) - _FIELDS
    if extra:
        return f"Unrecognized request argument supplied: {sorted(extra)[0]}"
    if not isinstance(request.get("model"), str):
        return "model is required"
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages must be a non-empty array"
    for i, message in enumerate(messages):
        if (problem := _check_message(message, i)) is not None:
            return problem
    for tool in request.get("tools") or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(function, dict)
            or tool.get("type") != "function"
            or not isinstance(function.get("name"), str)
        ):
            return "tools must be function tools with a name"
    return None


def _called_tool(request: Mapping[str, Any], text: str) -> Mapping[str, Any] | None:
    tools = [tool["function"] for tool in request.get("tools") or ()]
    choice = request.get("tool_choice")
    if not tools or choice == "none":
        return None
    by_name: dict[str, Mapping[str, Any]] = {tool["name"]: tool for tool in tools}
    if isinstance(choice, dict):
        return by_name.get(str((choice.get("function") or {}).get("name")))
    for match in _CALL.finditer(text):
        if match.group(1) in by_name:
            return by_name[match.group(1)]
    first: Mapping[str, Any] = tools[0]
    return first if choice == "required" else None


def _arguments(tool: Mapping[str, Any], text: str) -> str:
    schema = tool.get("parameters") or {}
    properties = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(properties, dict):
        return "{}"
    names = [name for name in schema.get("required") or () if name in properties]
    defaults = {"integer": 1, "number": 1, "boolean": True, "array": [], "object": {}}
    values = {
        name: defaults.get(str((properties[name] or {}).get("type")), text)
        if isinstance(properties[name], dict)
        else text
        for name in names
    }
    return orjson.dumps(values).decode()


def chat_reply(request: Mapping[str, Any]) -> wire.JSONObject:
    """The chat completion the echo backend answers a valid request with."""
    messages: Sequence[Mapping[str, Any]] = request["messages"]
    last = next((m for m in reversed(messages) if m["role"] in ("user", "tool")), None)
    said = (_text_of(last.get("content")) or "") if last is not None else "(continuing)"
    text = "echo: " + said
    finish = "stop"
    limit = request.get("max_completion_tokens") or request.get("max_tokens")
    if isinstance(limit, int) and len(text.encode()) > limit * 4:
        text, finish = text.encode()[: limit * 4].decode(errors="ignore"), "length"
    message: wire.JSONObject = {"role": "assistant", "content": text}
    tool = _called_tool(request, said) if finish == "stop" else None
    arguments = ""
    if tool is not None:
        arguments = _arguments(tool, said)
        call_id = wire.derived_id("call_", orjson.dumps(messages))
        message["tool_calls"] = [
            {"id": call_id, "type": "function", "function": {"name": tool["name"], "arguments": arguments}}
        ]
        finish = "tool_calls"
    prompt = _estimate(len(orjson.dumps(messages)) + len(orjson.dumps(request.get("tools") or [])))
    completion = max(1, _estimate(len(text.encode()) + len(arguments.encode())))
    return {
        "id": wire.random_id("chatcmpl-"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request["model"],
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
    }


def chunk_events(completion: Mapping[str, Any], *, include_usage: bool) -> list[bytes]:
    """A chat completion as the `data:` events of its stream, ending with `[DONE]`."""
    base = {k: completion[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    choice = completion["choices"][0]
    message = choice["message"]

    def chunk(delta: Mapping[str, Any], finish: str | None = None) -> bytes:
        body = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
        return b"data: " + orjson.dumps(body) + b"\n\n"

    events = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"content": piece}) for piece in wire.split_text(message.get("content") or "") if piece]
    for index, call in enumerate(message.get("tool_calls") or []):
        function = call["function"]
        head = {
            "index": index,
            "id": call["id"],
            "type": "function",
            "function": {"name": function["name"], "arguments": ""},
        }
        events.append(chunk({"tool_calls": [head]}))
        for piece in wire.split_json(function["arguments"]):
            events.append(chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]}))
    events.append(chunk({}, choice["finish_reason"]))
    if include_usage:
        events.append(b"data: " + orjson.dumps({**base, "choices": [], "usage": completion["usage"]}) + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return events


def chat_error_body(message: str, *, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}})
