"""What a turn reads and writes: the leased thread, a new thread, the commit, the backend's usage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ContinueRefusal = Literal["not_found", "already_continued", "in_flight"]


@dataclass(frozen=True, slots=True)
class LeasedThread:
    """A thread whose head this request holds the lease on."""

    id: str
    session_id: str | None
    system: bytes | None
    tools: bytes | None
    system_fp: str | None
    tools_fp: str | None
    output_config_fp: str | None
    fixed_markers: int
    head_position: int
    byte_count: int
    ttl_seconds: int


@dataclass(frozen=True, slots=True)
class NewThread:
    id: str
    owner: str
    tenant_id: str | None
    session_id: str | None
    metadata_user_id: str | None
    system: bytes | None
    tools: bytes | None
    system_fp: str | None
    tools_fp: str | None
    output_config_fp: str | None
    fixed_markers: int
    ttl_seconds: int


@dataclass(frozen=True, slots=True)
class TurnUsage:
    """The backend's token counts of one reply, added to the thread's totals at commit."""

    input_tokens: int = 0
    output_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


@dataclass(frozen=True, slots=True)
class TurnCommit:
    thread_id: str
    lease_token: str
    start_position: int
    rows: list[tuple[bytes, str | None]]  # message bytes, and the response id on the reply
    head_message_id: str
    expires_ms: int
    ttl_seconds: int
    now_ms: int
    metadata_user_id: str | None
    # (owner, session name) to bind to this thread in the commit's transaction, whatever thread holds the name now:
    # an explicit create with a session header (PROTOCOL §6).
    rebind_session: tuple[str, str] | None = None
    # The backend's own id of the reply (the last row), kept for cache diagnostics.
    reply_backend_id: str | None = None
    usage: TurnUsage = TurnUsage()
