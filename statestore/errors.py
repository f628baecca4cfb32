"""One exception tree for all that statestore rejects, rendered as Anthropic error bodies (docs/protocol.md §4)."""

from __future__ import annotations

from typing import Any, ClassVar

import orjson


class StatestoreError(Exception):
    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "api_error"
    error_code: ClassVar[str | None] = None

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    @property
    def headers(self) -> dict[str, str]:
        return {}

    def body(self, request_id: str) -> bytes:
        error: dict[str, Any] = {"type": self.error_type, "message": self.message}
        details = dict(self.details)
        if self.error_code is not None:
            details = {"error_code": self.error_code, **details}
        if details:
            error["details"] = details
        return orjson.dumps({"type": "error", "error": error, "request_id": request_id})


class InvalidRequest(StatestoreError):
    status = 400
    error_type = "invalid_request_error"


class RequestTooLarge(StatestoreError):
    status = 413
    error_type = "request_too_large"


class AuthenticationFailed(StatestoreError):
    status = 401
    error_type = "authentication_error"


class PermissionDenied(StatestoreError):
    status = 403
    error_type = "permission_error"


class NotFound(StatestoreError):
    status = 404
    error_type = "not_found_error"


class ContentErased(NotFound):
    """The conversation's data key was destroyed by an erasure: its content opens nowhere (a database restored from a
    backup taken before the erasure still holds the rows). Never retried."""

    error_code = "content_erased"

    @property
    def headers(self) -> dict[str, str]:
        return {"x-should-retry": "false"}


class MethodNotAllowed(StatestoreError):
    status = 405
    error_type = "invalid_request_error"


class ThreadError(StatestoreError):
    """Thread rejections: sent before any stream starts, and never retried by the SDK on its own."""

    status = 400
    error_type = "invalid_request_error"

    @property
    def headers(self) -> dict[str, str]:
        return {"x-should-retry": "false"}


class ThreadNotFound(ThreadError):
    status = 404
    error_type = "not_found_error"
    error_code = "thread_not_found"


class ThreadAlreadyContinued(ThreadError):
    error_code = "thread_already_continued"


class ThreadContinueInFlight(ThreadError):
    error_code = "thread_continue_in_flight"


class ThreadFingerprintMismatch(ThreadError):
    error_code = "thread_fingerprint_mismatch"


class ThreadUnsupportedRequest(ThreadError):
    error_code = "thread_unsupported_request"


class IdempotencyError(StatestoreError):
    """An `Idempotency-Key` this request cannot be served under (docs/protocol.md §11): the message names the key,
    never the request's content."""

    status = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, param="Idempotency-Key")


class InvalidIdempotencyKey(IdempotencyError):
    error_code = "invalid_idempotency_key"


class IdempotencyKeyInFlight(IdempotencyError):
    """The first request under the key is still running: a retry a moment later gets its outcome (the SDKs retry a
    409 by themselves, after `retry-after`)."""

    status = 409
    error_code = "idempotency_key_in_flight"

    @property
    def headers(self) -> dict[str, str]:
        return {"retry-after": "1"}


class IdempotencyKeyReused(IdempotencyError):
    """The key was used with another request: retrying this one cannot help."""

    status = 422
    error_code = "idempotency_key_reused"

    @property
    def headers(self) -> dict[str, str]:
        return {"x-should-retry": "false"}


# Seconds a client is asked to wait before retrying after an outage: the SDKs honour `retry-after` (and back off on
# their own without it); a database failover or restart takes seconds, not minutes.
OUTAGE_RETRY_AFTER_SECONDS = 2


class ServiceUnavailable(StatestoreError):
    """An outage (the database or Redis cannot be reached): retryable, and said so with `retry-after`."""

    status = 503
    error_type = "api_error"

    @property
    def headers(self) -> dict[str, str]:
        return {"retry-after": str(OUTAGE_RETRY_AFTER_SECONDS)}


class UpstreamUnreachable(StatestoreError):
    status = 502
    error_type = "api_error"


class UpstreamTimeout(StatestoreError):
    status = 504
    error_type = "timeout_error"


class UpstreamBusy(ServiceUnavailable):
    """No connection to the model backend came free within STATESTORE_UPSTREAM_POOL_TIMEOUT_SECONDS (all of
    STATESTORE_UPSTREAM_MAX_CONNECTIONS in use): the request was not sent, so a retry is safe."""


class StreamBrokenOff(Exception):
    """A response that already started cannot be completed (the backend's stream broke off, or the turn could not be
    committed): raising it makes the server cut the client's connection, which is how a client learns a stream is
    incomplete."""


class InternalError(StatestoreError):
    status = 500
    error_type = "api_error"


class UnopenableContent(InternalError):
    """A stored value failed to open under its data key (damaged, moved to another row or owner, or sealed while this
    process runs without encryption). Logged with its row, never its content, and never served."""
