"""A Chat Completions reply translated into a Response's parts: its output items, usage and status (the object that
holds them is responses/response_object.py's)."""

from __future__ import annotations

from typing import Any

from statestore.responses.errors import BackendError
from statestore.responses.ids import new_id


def usage_of(chat_usage: object) -> dict[str, Any]:
    usage = chat_usage if isinstance(chat_usage, dict) else {}
    prompt = _int(usage.get("prompt_tokens"))
    completion = _int(usage.get("completion_tokens"))
    prompt_details = usage.get("prompt_tokens_details") or {}
    completion_details = usage.get("completion_tokens_details") or {}
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": _int(prompt_details.get("cached_tokens")),
            "cache_write_tokens": _int(prompt_details.get("cache_write_tokens")),
        },
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": _int(completion_details.get("reasoning_tokens"))},
        "total_tokens": _int(usage.get("total_tokens")) or prompt + completion,
    }


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def message_item(text: str, *, item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id or new_id("msg_"),
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def call_item(
    call_id: str | None, name: str, arguments: str, *, item_id: str | None = None, status: str = "completed"
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id or new_id("fc_"),
        "call_id": call_id or new_id("call_"),
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def status_of(finish_reason: object) -> tuple[str, dict[str, Any] | None]:
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    return "completed", None


def output_of(completion: object) -> tuple[list[dict[str, Any]], str, dict[str, Any] | None, dict[str, Any]]:
    """(output items, status, incomplete_details, usage) of a non-streamed chat completion."""
    if not isinstance(completion, dict):
        raise BackendError("the model backend's reply is not a chat completion")
    choices = completion.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise BackendError("the model backend's reply has no choices")
    message = choices[0].get("message")
    if not isinstance(message, dict):
        raise BackendError("the model backend's reply has no message")
    output: list[dict[str, Any]] = []
    content = message.get("content")
    calls = message.get("tool_calls") or []
    if isinstance(content, str) and (content or not calls):
        output.append(message_item(content))
    for call in calls if isinstance(calls, list) else []:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise BackendError("the model backend's reply has a malformed tool call")
        arguments = function.get("arguments")
        output.append(call_item(call.get("id"), function["name"], arguments if isinstance(arguments, str) else "{}"))
    status, incomplete = status_of(choices[0].get("finish_reason"))
    return output, status, incomplete, usage_of(completion.get("usage"))
