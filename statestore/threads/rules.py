"""The pure rules of a threaded turn (docs/protocol.md §2-§4): what may be stored, what a thread may hold, which fields
are fixed, and which error a refused continue gets."""

from __future__ import annotations

from typing import Any

from statestore.errors import (
    InvalidRequest,
    RequestTooLarge,
    StatestoreError,
    ThreadAlreadyContinued,
    ThreadContinueInFlight,
    ThreadFingerprintMismatch,
    ThreadNotFound,
    ThreadUnsupportedRequest,
)
from statestore.policy import Policy
from statestore.store.turn_records import ContinueRefusal, LeasedThread
from statestore.threads import assembly
from statestore.threads.turn import ThreadTurn

MAX_CACHE_MARKERS = 3


def storable(message: dict[str, Any]) -> bool:
    """Refusals and replies a fallback model wrote are returned but not stored (docs/protocol.md §2)."""
    if message.get("stop_reason") == "refusal":
        return False
    usage = message.get("usage")
    iterations = usage.get("iterations") if isinstance(usage, dict) else None
    return not (
        isinstance(iterations, list)
        and any(isinstance(it, dict) and it.get("type") == "fallback_message" for it in iterations)
    )


def refusal(reason: ContinueRefusal) -> StatestoreError:
    if reason == "already_continued":
        return ThreadAlreadyContinued("this response id is not the thread's latest response; continue from the latest")
    if reason == "in_flight":
        return ThreadContinueInFlight("another request is continuing from this response id right now")
    return ThreadNotFound("no live thread has a response with this id")


def check_markers(count: int) -> None:
    if count > MAX_CACHE_MARKERS:
        raise ThreadUnsupportedRequest(
            f"a thread request may carry at most {MAX_CACHE_MARKERS} block cache_control markers, stored ones "
            f"included; this one has {count}",
            unsupported=["cache_control"],
        )


def check_limits(policy: Policy, *, messages: int, size: int) -> None:
    if messages > policy.max_messages:
        raise InvalidRequest(f"the thread would exceed its limit of {policy.max_messages} messages")
    if size > policy.max_thread_bytes:
        raise RequestTooLarge(f"the thread would exceed its limit of {policy.max_thread_bytes} bytes")


def check_fixed_fields(leased: LeasedThread, turn: ThreadTurn) -> None:
    differing = []
    if turn.has_system and assembly.fingerprint(turn.system) != leased.system_fp:
        differing.append("system")
    if turn.has_tools and assembly.fingerprint(turn.tools) != leased.tools_fp:
        differing.append("tools")
    if assembly.fingerprint(turn.fields.get("output_config")) != leased.output_config_fp:
        differing.append("output_config")
    if differing:
        raise ThreadFingerprintMismatch(
            "these fields differ from the ones the thread was created with: "
            + ", ".join(differing)
            + "; send the stored values, or replay the conversation with a new thread to change them"
        )


def check_policy(policy: Policy, turn: ThreadTurn) -> None:
    if not policy.threads_enabled:
        raise ThreadUnsupportedRequest("threads are turned off for this owner", unsupported=[])
    if turn.session is not None and not policy.sessions_enabled:
        raise ThreadUnsupportedRequest("sessions are turned off for this owner", unsupported=[])
