"""Response models of statestore's own APIs, so /openapi.json describes every response (/statestore/v1 and
/admin/v1). The routes build plain dicts and FastAPI checks them against these; a field added to a response is added
here, and the live-response test (tests/integration/test_typed_api.py) holds the two together."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from statestore.policy_fields import POLICY_FIELDS


class ErrorDetail(BaseModel):
    type: str = Field(description="invalid_request_error, authentication_error, permission_error, not_found_error, ...")
    message: str
    details: dict[str, Any] | None = Field(default=None, description="error_code and other specifics, when any")


class ErrorResponse(BaseModel):
    """Anthropic's error shape, on every route."""

    type: Literal["error"]
    error: ErrorDetail
    request_id: str


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a router: these statuses answer with the error shape."""
    described = {
        400: "invalid request",
        401: "missing or unknown credential",
        403: "not allowed",
        404: "not found (another owner's thread is also 404)",
        409: "conflict",
        503: "the database (or a Redis it needs) is unavailable: retry after `retry-after` seconds",
    }
    described_503 = {"headers": {"retry-after": {"description": "seconds to wait", "schema": {"type": "integer"}}}}
    return {
        status: {"model": ErrorResponse, "description": described[status], **(described_503 if status == 503 else {})}
        for status in statuses
    }


class MessageTokensCount(BaseModel):
    """`POST /v1/messages/count_tokens`: the backend's answer as it came (other fields it sends are kept); over a
    thread without a backend count, statestore's estimate."""

    model_config = ConfigDict(extra="allow")
    input_tokens: int = Field(ge=0)


# -- thread API (/statestore/v1) ----------------------------------------------------------------------------------


class ThreadUsage(BaseModel):
    """The backend's usage of the stored turns, added up."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    turns: int


class ThreadContext(BaseModel):
    """What a rebuild sends (docs/protocol.md §9): the archive holds every message, the context only these."""

    tokens: int = Field(description="the context's size after the last turn, from the backend's usage")
    base_position: int = Field(description="the first stored message a rebuild sends")
    message_count: int
    bytes: int
    compacted: int = Field(description="how many times a compaction reply moved the base")
    truncated: int
    summarized: int


class Thread(BaseModel):
    """A thread's metadata. Times are RFC 3339, UTC, in milliseconds."""

    id: str = Field(examples=["thr_4B2mQh0pSa1Y0bXkzGmT8c"])
    type: Literal["thread"]
    created_at: str
    last_used_at: str
    expires_at: str
    message_count: int
    turn_count: int
    bytes: int = Field(description="stored size of the thread's messages, system and tools")
    session_id: str | None
    head_message_id: str | None = Field(description="the response id the next turn continues from")
    usage: ThreadUsage
    context: ThreadContext


class ThreadList(BaseModel):
    data: list[Thread]
    has_more: bool
    first_id: str | None
    last_id: str | None


class ThreadDeleted(BaseModel):
    id: str
    type: Literal["thread_deleted"]


class Session(BaseModel):
    id: str
    type: Literal["session"]
    thread: Thread


class ThreadExport(BaseModel):
    """The thread as a Messages API request body: send it as it is to replay the conversation."""

    model: str | None = Field(
        default=None, description="the latest turn's (absent on threads stored before migration 0007)"
    )
    max_tokens: int | None = Field(default=None, description="the latest turn's (absent as model is)")
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    messages: list[dict[str, Any]]


# -- admin API (/admin/v1) ----------------------------------------------------------------------------------------

_PASSTHROUGH_NOTE = (
    "present only in passthrough mode, where tenants, keys and tenant policies take no effect (STATESTORE_AUTH_MODE)"
)


class Tenant(BaseModel):
    id: str
    name: str
    disabled: bool
    created_ms: int


class CreatedTenant(Tenant):
    warning: str | None = Field(default=None, description=_PASSTHROUGH_NOTE)


class TenantList(BaseModel):
    data: list[Tenant]


class ApiKey(BaseModel):
    id: str
    tenant_id: str
    label: str | None
    prefix: str = Field(description="the first characters of the secret, to recognise it by")
    created_ms: int
    revoked_ms: int | None


class CreatedApiKey(ApiKey):
    secret: str = Field(description="shown this once; statestore keeps only its hash")
    warning: str | None = Field(default=None, description=_PASSTHROUGH_NOTE)


class ApiKeyList(BaseModel):
    data: list[ApiKey]


# Every field of statestore/policy_fields.py, so a field added there is described here too.
PolicyValues = create_model(
    "PolicyValues",
    **{f.name: (f.python_type, Field(description=f.help)) for f in POLICY_FIELDS},  # type: ignore[call-overload]
)


class PolicyField(BaseModel):
    name: str
    kind: str
    help: str
    required: bool
    default: Any
    nullable: bool
    minimum: float | None
    maximum: float | None
    choices: list[str]
    max_length: int | None


class PolicyFields(BaseModel):
    data: list[PolicyField]


class PolicyView(BaseModel):
    scope: str = Field(description="'default' or the tenant as given")
    source: Literal["settings", "default", "tenant"] = Field(description="where the policy in force comes from")
    policy: PolicyValues


class PolicySet(PolicyView):
    warning: str | None = Field(default=None, description=_PASSTHROUGH_NOTE)


class AuditEntry(BaseModel):
    model_config = ConfigDict(json_schema_extra={"description": "who changed what, before and after"})

    id: int
    at_ms: int
    actor: str
    action: str
    target: str | None
    before: Any
    after: Any


class AuditPage(BaseModel):
    data: list[AuditEntry]
    has_more: bool


class Purged(BaseModel):
    """What the purge deleted, by kind: the Messages door's threads, the Responses door's responses and
    conversations."""

    purged_threads: int
    purged_responses: int
    purged_conversations: int


class Erasure(BaseModel):
    """An erasure of a tenant's and/or a user's threads, responses and conversations, live or expired (database rows
    and cache entries). `running` until nothing it erases is readable anywhere, then `done` with what it deleted;
    `failed` if it stopped on an error: run again by the servers at `retry_at` (a lease after its first run, twice as
    long after each further failure, 6 runs in all), and failed for good, `retry_at` null, after the last (send it
    again: erasing is idempotent). One whose replica stopped is taken up by another within about a lease
    (STATESTORE_LEASE_SECONDS), and its counts are all its runs'."""

    id: str
    status: Literal["running", "done", "failed"]
    tenant_id: str | None
    user_id: str | None
    created_at: str | None
    finished_at: str | None
    erased_threads: int | None = Field(description="once done")
    erased_responses: int | None = Field(
        description="once done; the Responses front door's: every tree holding a matching response (and the items a "
        "matching response brought into any conversation)"
    )
    erased_conversations: int | None = Field(description="once done")
    attempts: int = Field(
        description="its runs so far, the first included (a run taken up after its replica stopped is the same one)"
    )
    retry_at: str | None = Field(
        description="failed and to be run again from then on, by any server; null once running, done, or failed "
        "for good"
    )


class DoorUsage(BaseModel):
    turns: int
    bytes: int


class UsageDoors(BaseModel):
    messages: DoorUsage = Field(description="the Messages API's threads and sessions")
    responses: DoorUsage = Field(description="the Responses API's responses and conversations")


class UsageDay(BaseModel):
    day: str = Field(description="YYYY-MM-DD, UTC")
    turns: int = Field(description="turns stored that day, through both doors")
    bytes: int = Field(description="bytes those turns stored")
    doors: UsageDoors


class UsagePage(BaseModel):
    """Turns and bytes stored on each day, oldest first."""

    data: list[UsageDay]


class Stats(BaseModel):
    # The Messages door's threads and sessions.
    live_threads: int
    live_messages: int
    live_bytes: int
    expired_awaiting_purge: int = Field(description="expired threads")
    purged_threads_total: int
    erased_threads_total: int
    # The Responses door's responses and conversations.
    live_responses: int
    live_conversations: int
    expired_responses_awaiting_purge: int = Field(
        description="responses of trees whose every response has expired (a tree is kept while one is live)"
    )
    expired_conversations_awaiting_purge: int
    purged_responses_total: int
    erased_responses_total: int
    purged_conversations_total: int
    erased_conversations_total: int
    # Background responses not yet expired, by status (docs/responses.md, "Background responses").
    background_queued: int = Field(description="background responses waiting for a replica")
    background_running: int = Field(description="background responses a replica is running")
    background_completed: int
    background_incomplete: int
    background_failed: int
    background_cancelled: int
    purger_last_run_at: str | None = Field(
        description="when a purge last ran on this database, the background purger's or an admin's (ISO 8601, "
        "UTC); null before the first"
    )
    purger_last_run_ms: int = Field(
        deprecated=True,
        description="deprecated, to be removed in the next release: purger_last_run_at as epoch milliseconds (0 "
        "before the first run)",
    )
