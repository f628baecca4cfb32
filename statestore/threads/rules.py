"""The pure rules of a threaded turn (docs/protocol.md §2-§4): what may be stored, what a thread may hold, which fields
are fixed, and which error a refused continue gets."""

from __future__ import annotations

from typing import Any

from statestore.core.policy_enforcement import PolicyRefusal, TurnMeasures, enforce
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


def thread_error(refusal: PolicyRefusal) -> StatestoreError:
    """A policy's refusal (core/policy_enforcement.py) in the Messages door's shape."""
    if refusal.field == "max_messages":
        return InvalidRequest(f"the thread would exceed its limit of {refusal.limit} messages")
    if refusal.field == "max_thread_bytes":
        return RequestTooLarge(f"the thread would exceed its limit of {refusal.limit} bytes")
    if refusal.field == "threads_enabled":
        return ThreadUnsupportedRequest("threads are turned off for this owner", unsupported=[])
    return ThreadUnsupportedRequest(refusal.message, unsupported=[])


def enforced(policy: Policy, measures: TurnMeasures) -> int:
    """`enforce` for a threaded turn: the TTL it gets, or the refusal as a thread error."""
    try:
        return enforce(policy, measures)
    except PolicyRefusal as refusal:
        raise thread_error(refusal) from None


def check_limits(policy: Policy, *, messages: int, size: int, ttl_header: bytes | None, current_ttl: int | None) -> int:
    """The policy's bounds on what the rebuilt request carries (the limits count what is sent, not the archive), and
    the TTL the thread gets."""
    measures = TurnMeasures(messages=messages, size=size, requested_ttl=ttl_header, current_ttl=current_ttl)
    return enforced(policy, measures)


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
    """Before anything is taken: whether the owner may store threads, and name sessions."""
    enforced(policy, TurnMeasures(session=turn.session is not None))
