"""The Response object, built here and nowhere else: the JSON answer of a turn, every streamed event's `response`, a
stored or background response as served (docs/responses.md, "The Open Responses specification"). Complete and typed as
the Open Responses specification (2026-04-24) requires and the `openai` SDK reads it: every field present, and the
sampling fields the numbers the turn was sampled with.

A response stored before the object was complete is completed as it is served (`completed`): its rows are never
rewritten (they may be sealed under keys only a request's owner opens)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from statestore.responses.request import TurnRequest

# What a Response says of a request that left these out. Sampling: the specification's defaults, which are Chat
# Completions' own; statestore cannot know defaults a backend applies of its own accord (a model's generation config),
# so a client that depends on the figure sends it. No log probabilities are returned and no built-in tool runs
# (`top_logprobs`, `max_tool_calls` are echoed as sent), and the backend is asked for no service tier: it served the
# turn in its `default` one.
ECHO_DEFAULTS: dict[str, Any] = {
    "max_output_tokens": None,
    "max_tool_calls": None,
    "parallel_tool_calls": True,
    "reasoning": {"effort": None, "summary": None},
    "temperature": 1.0,
    "top_p": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "top_logprobs": 0,
    "service_tier": "default",
    "safety_identifier": None,
    "prompt_cache_key": None,
    "text": {"format": {"type": "text"}},
    "tool_choice": "auto",
    "tools": [],
}


def response_object(
    response_id: str,
    turn: TurnRequest,
    *,
    created_at: int,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    incomplete_details: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The turn's Response as it stands. `completed_at` is set when `status` is completed (now), as the SDK reads it;
    it comes right after `created_at`, where `completed` looks for it."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "completed_at": int(time.time()) if status == "completed" else None,
        "status": status,
        "background": turn.background,
        "error": None,
        "incomplete_details": incomplete_details,
        "instructions": turn.instructions,
        "model": turn.model,
        "output": output,
        "previous_response_id": turn.previous_response_id,
        "conversation": {"id": turn.conversation_id} if turn.conversation_id else None,
        "store": turn.store,
        "truncation": turn.truncation,
        "usage": usage,
        "metadata": turn.metadata,
        **turn.echo,
    }


def unfinished(response: dict[str, Any], status: str) -> dict[str, Any]:
    """The Response as it stood before its turn finished (`queued`, `in_progress`): no output, usage or outcome yet."""
    return {
        **response,
        "status": status,
        "completed_at": None,
        "output": [],
        "usage": None,
        "error": None,
        "incomplete_details": None,
    }


# Where a Response built by `response_object` says it is whole: its `completed_at` follows `created_at` within the
# first bytes (an id of up to 64 characters and a ten-digit time fit well within them).
_WHOLE = b',"completed_at":'
_WHOLE_WITHIN = 192


def completed(body: bytes) -> bytes:
    """A stored Response as it is served: as stored, unless an earlier version stored it without the fields the
    object has since gained (then completed as `complete` says)."""
    if body.find(_WHOLE, 0, _WHOLE_WITHIN) != -1:
        return body
    response = orjson.loads(body)
    if not isinstance(response, dict) or "completed_at" in response:
        return body
    return orjson.dumps(complete(response))


def complete(response: dict[str, Any]) -> dict[str, Any]:
    """A Response stored by an earlier version, completed: the fields it lacks as a request that left them out would
    have them (its sampling fields stored as null are the defaults, which is what the backend was sent: nothing), and
    `completed_at` when it completed, its `created_at` (the time it completed was not kept). A whole one is returned
    as it is."""
    if "completed_at" in response:
        return response
    whole: dict[str, Any] = {}
    for name, value in response.items():
        whole[name] = value
        if name == "created_at":
            whole["completed_at"] = value if response.get("status") == "completed" else None
    whole.setdefault("completed_at", None)
    for name, default in ECHO_DEFAULTS.items():
        if whole.get(name) is None:
            whole[name] = default
    text = whole["text"]
    fmt = text.get("format") if isinstance(text, dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        echoed = {**fmt, "description": fmt.get("description"), "strict": bool(fmt.get("strict"))}
        whole["text"] = {**text, "format": echoed}
    return whole
