"""What a turn reads and writes: the leased thread, a new thread, the commit, the backend's usage."""

from __future__ import annotations

from dataclasses import field
from typing import Literal

from statestore.content_keys import CLEAR, ContentSealer
from statestore.records import record

ContinueRefusal = Literal["not_found", "already_continued", "in_flight"]


@record
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
    # The context a rebuild sends (docs/protocol.md §9): stored messages from base_position on, after a head of
    # head_bytes.
    base_position: int = 0
    base_bytes: int = 0
    head_bytes: int = 0
    context_tokens: int = 0
    # Whose it is (the erasure scope its content is sealed under: store/thread_sealing.py).
    owner: str = ""
    tenant_id: str | None = None
    metadata_user_id: str | None = None

    @property
    def context_messages(self) -> int:
        return self.head_position - self.base_position + (1 if self.head_bytes else 0)

    @property
    def context_bytes(self) -> int:
        return self.byte_count - self.base_bytes + self.head_bytes


@record
class HeadAfter:
    """A thread's row as its commit left it, as the commit returns it (PostgreSQL): what a claimed continue reads
    back from Redis (store/thread_claims.py) with the fixed fields it had."""

    head_position: int
    byte_count: int
    ttl_seconds: int
    expires_ms: int
    base_position: int
    base_bytes: int
    head_bytes: int
    context_tokens: int
    metadata_user_id: str | None


@record
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


@record
class TurnUsage:
    """The backend's token counts of one reply, added to the thread's totals at commit."""

    input_tokens: int = 0
    output_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


ContextAction = Literal["compacted", "truncated", "summarized"]


@record
class ContextMove:
    """The base moving forward (docs/protocol.md §9): from now on a rebuild sends `head` (when not None) and then the
    stored messages from `base_position` on; `base_bytes` is the bytes of the stored messages before it."""

    base_position: int
    base_bytes: int
    head: bytes | None
    actions: tuple[ContextAction, ...]

    def count(self, action: ContextAction) -> int:
        return self.actions.count(action)


@record
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
    # an explicit create with a session header (docs/protocol.md §6).
    rebind_session: tuple[str, str] | None = None
    # The backend's own id of the reply (the last row), kept for cache diagnostics.
    reply_backend_id: str | None = None
    usage: TurnUsage = field(default_factory=TurnUsage)
    model: str | None = None
    max_tokens: int | None = None
    # The context's size in tokens after this turn, and the move of its base, if any (docs/protocol.md §9).
    context_tokens: int = 0
    move: ContextMove | None = None
    # Encryption at rest: the thread's owner and the sealer of its scope; the rows and the head are sealed at commit
    # (CLEAR when encryption is off: stored as they are).
    owner: str = ""
    sealer: ContentSealer = CLEAR
    # A turn that claimed the head in Redis holds no lease in the database: its commit is a compare-and-set on the
    # head it was sent with (`expected_head`), refused while a database lease is live (store/thread_claims.py).
    expected_head: str | None = None
