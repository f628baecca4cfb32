"""`response.steer` in WebSocket mode (docs/responses.md): user input queued for the continuation of a response the
connection is running, and the events that tell the client what became of it (the SDK's
`response.steer.accepted` / `.pending` / `.failed`). Only the checks and the events live here; the connection
(api/responses_socket.py) runs the continuation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from statestore.responses.errors import BadRequest
from statestore.responses.ids import new_id
from statestore.responses.request import turn_of_event

MAX_PENDING = 16  # steering submissions queued for one response at once


@dataclass(slots=True)
class Steer:
    id: str
    previous_response_id: str
    raw: Any  # the input as the client sent it, handed back as sent when it cannot be committed
    items: list[dict[str, Any]]  # the input as the continuation's input items


@dataclass(slots=True)
class SteerTarget:
    """A response the connection runs, or ran and waits on (its function calls need their outputs): what was steered
    into it so far, in submission order."""

    response_id: str
    supported: bool  # not on a conversation, not compacting its context (steering_not_supported)
    queued: list[Steer] = field(default_factory=list)
    waiting: bool = False  # completed with calls to answer: queued input joins the client's next response.create
    required: list[dict[str, Any]] = field(default_factory=list)  # the stubs of those calls' outputs


class SteerRefused(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def read_steer(event: dict[str, Any]) -> tuple[str, Any, list[dict[str, Any]]]:
    """(previous_response_id, input as sent, input items) of a `response.steer` event; SteerRefused (invalid_input)
    for anything else than user messages, as the SDK's type allows."""
    extra = sorted(set(event) - {"type", "previous_response_id", "input"})
    if extra:
        raise SteerRefused("invalid_input", f"Unknown parameter: '{extra[0][:64]}'.")
    previous = event.get("previous_response_id")
    raw = event.get("input")
    if not isinstance(previous, str) or not previous:
        raise SteerRefused("invalid_input", "Missing required parameter: 'previous_response_id'.")
    if not (isinstance(raw, str) and raw) and not (isinstance(raw, list) and raw):
        raise SteerRefused("invalid_input", "'input' must be a non-empty string or a non-empty array of messages.")
    if isinstance(raw, list):
        for item in raw:
            if not isinstance(item, dict) or item.get("role") != "user" or item.get("type", "message") != "message":
                raise SteerRefused("invalid_input", "Steering accepts only messages with the user role.")
            if set(item) - {"type", "role", "content"}:
                raise SteerRefused("invalid_input", "A steering message holds only 'type', 'role' and 'content'.")
    try:
        # Validated and made items as a create's input is (the model is the continuation's, not checked here).
        items = turn_of_event({"model": "-", "input": raw}).input
    except BadRequest as exc:
        raise SteerRefused("invalid_input", exc.message) from None
    return previous, raw, items


def new_steer(previous: str, raw: Any, items: list[dict[str, Any]]) -> Steer:
    return Steer(new_id("steer_"), previous, raw, items)


def accepted(steer: Steer) -> dict[str, Any]:
    steered = {"id": steer.id, "previous_response_id": steer.previous_response_id}
    return {"type": "response.steer.accepted", "steer": steered}


def pending(steer: Steer, required: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "type": "response.steer.pending",
        "reason": "waiting_for_required_input",
        "required_input": required,
        "steer": {"id": steer.id, "previous_response_id": steer.previous_response_id},
    }


def failed(previous: str, raw: Any, code: str, message: str, steer_id: str | None = None) -> dict[str, Any]:
    steer: dict[str, Any] = {"input": raw, "previous_response_id": previous}
    if steer_id is not None:
        steer["id"] = steer_id
    return {
        "type": "response.steer.failed",
        "error": {"type": "invalid_request_error", "code": code, "message": message},
        "steer": steer,
    }


def required_input(response: bytes) -> list[dict[str, Any]]:
    """The outputs a completed response waits for: a stub per function call (call_id and name), which the client
    fills with the call's output in its next `response.create`."""
    output = orjson.loads(response).get("output") or []
    return [
        {"type": "function_call_output", "call_id": item["call_id"], "name": item["name"]}
        for item in output
        if isinstance(item, dict) and item.get("type") == "function_call"
    ]
