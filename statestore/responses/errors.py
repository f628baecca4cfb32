"""Errors of the Responses front door, in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import orjson

from statestore.core.policy_enforcement import PolicyRefusal
from statestore.errors import StatestoreError

# The routes whose errors are in OpenAI's shape.
OPENAI_PATHS = ("/v1/responses", "/v1/conversations")

# OpenAI's `type` for statestore's own rejections of other front-door errors (auth, size, ...).
_OPENAI_TYPES = {
    "invalid_request_error": "invalid_request_error",
    "authentication_error": "invalid_request_error",
    "permission_error": "invalid_request_error",
    "not_found_error": "invalid_request_error",
    "request_too_large": "invalid_request_error",
    "timeout_error": "server_error",
}


class OpenAIError(StatestoreError):
    """Rendered in OpenAI's error shape wherever the app renders a StatestoreError."""

    status = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, *, status: int | None = None, param: str | None = None, code: str | None = None):
        super().__init__(message)
        if status is not None:
            self.status = status  # type: ignore[misc]
        self.param = param
        self.code = code
        self.carried: dict[str, str] = {}  # the headers of the error this one renders (as_openai)

    @property
    def headers(self) -> dict[str, str]:
        return self.carried

    def body(self, request_id: str) -> bytes:
        return orjson.dumps(
            {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}
        )


class BadRequest(OpenAIError):
    pass


class RateLimited(OpenAIError):
    status = 429
    error_type = "rate_limit_error"


class NotFound(OpenAIError):
    status = 404


class BackendError(OpenAIError):
    """A Chat Completions backend's error, relayed with its status."""

    status = 502
    error_type = "server_error"


def previous_response_not_found(response_id: str) -> BadRequest:
    return BadRequest(
        f"Previous response with id '{response_id}' not found.",
        param="previous_response_id",
        code="previous_response_not_found",
    )


def response_not_found(response_id: str) -> NotFound:
    return NotFound(f"Response with id '{response_id}' not found.")


def conversation_not_found(conversation_id: str) -> NotFound:
    return NotFound(f"Conversation with id '{conversation_id}' not found.", param="conversation")


def conversation_locked() -> BadRequest:
    return BadRequest(
        "Another request is operating on this conversation. Please try again after it completes.",
        param="conversation",
        code="conversation_locked",
    )


def as_openai(error: StatestoreError) -> OpenAIError:
    """Any statestore rejection (authentication, body size, an unreachable backend) in OpenAI's shape."""
    if isinstance(error, OpenAIError):
        return error
    param = error.details.get("param")
    converted = OpenAIError(error.message, status=error.status, param=param if isinstance(param, str) else None)
    converted.carried = error.headers  # retry-after on an outage, x-should-retry: false on an erased conversation
    converted.error_type = _OPENAI_TYPES.get(error.error_type, "server_error")  # type: ignore[misc]
    if error.status == 401:
        converted.code = "invalid_api_key"
    elif error.error_code is not None:
        converted.code = error.error_code  # e.g. content_erased: what a client can act on, in OpenAI's field for it
    return converted


def policy_error(refusal: PolicyRefusal) -> BadRequest:
    """A policy's refusal (core/policy_enforcement.py) in OpenAI's shape, naming the request field it concerns."""
    if refusal.field == "threads_enabled":
        return BadRequest(
            "Storing responses is disabled by this deployment's retention policy; send store: false.",
            param="store",
            code="storage_disabled",
        )
    if refusal.field == "max_messages":
        return BadRequest(
            f"The conversation would exceed this deployment's limit of {refusal.limit} messages.",
            param="input",
            code="too_many_messages",
        )
    if refusal.field == "max_thread_bytes":
        return BadRequest(
            f"The conversation would exceed this deployment's limit of {refusal.limit} bytes.",
            param="input",
            code="context_too_large",
        )
    if refusal.field == "max_background_turns":
        return BadRequest(
            "Background responses are disabled by this deployment's policy.",
            param="background",
            code="background_disabled",
        )
    return BadRequest(refusal.message)
