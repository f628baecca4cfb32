"""A turn between `ThreadService.begin` and its end: what is forwarded, what is stored if the reply completes, and
the headers that name the thread; and the completed reply as the thread stores it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from statestore.content_keys import CLEAR, ContentSealer
from statestore.core.lease_keeper import LeaseKeeper
from statestore.policy import Policy
from statestore.records import record
from statestore.store.turn_records import LeasedThread, TurnUsage
from statestore.threads.context_step import ContextStep, Summarize
from statestore.threads.turn import ThreadTurn

Outcome = Literal["open", "stored", "given_back"]
CONTEXT_HEADER = b"statestore-context"
CONTEXT_FALLBACK_HEADER = b"statestore-context-fallback"


def rfc3339(ms: int) -> bytes:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ms // 1000)).encode()


@record
class Recut:
    """A continue's state as it was prepared: enough to plan its context again."""

    leased: LeasedThread
    turn: ThreadTurn
    policy: Policy
    forwarded: list[bytes]  # the turn's new messages as forwarded
    summarize: Summarize | None


@dataclass(slots=True)
class HeadClaim:
    """A Redis claim a turn holds on `head`, and whether it took the database's lease too (beside the claim when the
    row was not served from Redis, or when the turn ran longer than a third of the lease), to give back."""

    head: str
    leased: bool
    name: str  # the claim's (store/thread_claims.py claim_name: the head and the owner)


@dataclass(slots=True)
class PreparedTurn:
    """A turn holding the thread head: what to forward, and what to store if the reply completes."""

    thread_id: str
    lease_token: str
    creating: bool
    start_position: int
    new_rows: list[bytes]
    response_id: str
    ttl_seconds: int
    expires_ms: int
    session: str | None
    metadata_user_id: str | None
    upstream_body: bytes
    history_count: int
    anthropic_beta: str
    stream: bool
    keeper: LeaseKeeper | None = None
    outcome: Outcome = field(default="open")
    # The context (docs/protocol.md §9): the archive's bytes before this turn, the thread's system and tools bytes, the
    # base move this turn makes before it is forwarded, and whether its reply compacted.
    archive_bytes: int = 0
    fixed_bytes: int = 0
    moved: ContextStep | None = None
    compacted: bool = False
    # An explicit create that names a session: (owner, name), bound to this thread when its reply commits
    # (docs/protocol.md §6).
    rebind_session: tuple[str, str] | None = None
    # The turn's model and max_tokens, kept on the thread for its export (`replay_fields`).
    replay: tuple[str | None, int | None] = (None, None)
    # A continue whose context the policy manages: what a cut after the backend's refusal needs (refusal_retry.py).
    recut: Recut | None = None
    # Encryption at rest: the thread's owner and the sealer of its scope (CLEAR when off); the context the turn read
    # from a sealed cache entry of many frames, which the commit writes back as one (threads/context_cache.py).
    owner: str = ""
    sealer: ContentSealer = CLEAR
    history: bytes = b""
    cache_frames: int = 0
    # The Redis claim the turn holds on its head (store/thread_claims.py), freed at its end; `row`: the thread's fixed
    # fields, kept with the row the commit returns for the next claimed continue.
    claim: HeadClaim | None = None
    row: LeasedThread | None = None
    # The `metadata.user_id` the thread's rows are sealed under and erased with: the thread's, or this turn's when the
    # thread has none yet (an Idempotency-Key's outcome is kept under it too, api/threaded_keyed.py).
    scope_user_id: str | None = None

    @property
    def expected_head(self) -> str | None:
        """The head a claimed turn was sent with: its commit goes by its lease, or else by a compare-and-set on it."""
        return self.claim.head if self.claim is not None else None

    def stop_keeper(self) -> None:
        if self.keeper is not None:
            self.keeper.stop()
            self.keeper = None

    def headers(self) -> list[tuple[bytes, bytes]]:
        """The response headers that name the thread (docs/protocol.md §2, §6)."""
        headers = [
            (b"statestore-thread-id", self.thread_id.encode()),
            (b"statestore-expires-at", rfc3339(self.expires_ms)),
        ]
        if self.session is not None:
            headers.append((b"statestore-session-id", self.session.encode()))
        if self.compacted:
            headers.append((CONTEXT_HEADER, b"compacted"))
        elif self.moved is not None:
            headers.append((CONTEXT_HEADER, self.moved.action.encode()))
        if self.moved is not None and self.moved.summary_failed:
            headers.append((CONTEXT_FALLBACK_HEADER, b"summary_failed"))
        return headers


@record
class CompletedReply:
    """A reply the backend finished, as the thread stores it."""

    row: bytes  # the assistant message, encoded once
    backend_id: str | None
    usage: TurnUsage
    # The reply cut to its compaction block, when it has one: the base moves there (docs/protocol.md §9).
    compaction: bytes | None = None


_MAX_MODEL_CHARS = 256  # threads.last_model
_MAX_INT32 = 2**31 - 1  # threads.last_max_tokens


def replay_fields(turn: ThreadTurn) -> tuple[str | None, int | None]:
    """The turn's `model` and `max_tokens` as the thread keeps them for its export, each None when the column could
    not hold it: an odd value the backend accepted must not fail the commit after the reply."""
    model = turn.fields.get("model")
    max_tokens = turn.fields.get("max_tokens")
    return (
        model if isinstance(model, str) and len(model) <= _MAX_MODEL_CHARS and "\x00" not in model else None,
        max_tokens
        if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and 0 <= max_tokens <= _MAX_INT32
        else None,
    )
