"""The owner's retention policy enforced on a turn, once for both doors (docs/policies.md): the Messages door
(threads/) and the Responses door (responses/) measure a turn in their own format, call `enforce` with what they
measured, and only translate a `PolicyRefusal` into their error shape.

A door calls `enforce` as soon as it knows a measure (whether the turn stores, before anything is taken; the messages
and bytes the rebuilt request carries, once its stored context is read), so a refusal comes before the backend is
asked and with nothing held. A measure left out (None) is not checked by that call. The context fields
(context_strategy, context_window_tokens, the ratios, summary_*) shape what is sent rather than refuse it: the planner
applies them (core/planner.py), on both doors.
"""

from __future__ import annotations

from dataclasses import dataclass

from statestore.policy import Policy


class PolicyRefusal(Exception):
    """The turn is refused by the policy field `field`; `limit`: that field's value, when it is a bound."""

    def __init__(self, field: str, message: str, limit: int | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.message = message
        self.limit = limit


@dataclass(frozen=True, slots=True)
class TurnMeasures:
    """What a door measured of a turn, in the policy's terms."""

    stores: bool = True  # the turn stores what it says (a Responses turn with `store: false` does not)
    session: bool = False  # the turn names a session (statestore-session-id)
    messages: int | None = None  # the messages the rebuilt request carries, the reply included
    size: int | None = None  # the bytes of stored context the rebuilt request carries, the new turn's included
    # A background turn: refused when the policy turns them off. The bound itself (max_background_turns queued or
    # running at once) is a count the store keeps and checks in the statement that queues the turn, so that two
    # turns admitted at once cannot both take the last place (store/background_store.py).
    background: bool = False
    requested_ttl: bytes | None = None  # the statestore-ttl header, as sent
    current_ttl: int | None = None  # the TTL the stored context has now (a continue), or None (a new one)


def enforce(policy: Policy, measures: TurnMeasures) -> int:
    """Raise PolicyRefusal when `policy` refuses the turn `measures` describes; else the TTL, in seconds, the turn's
    stored context gets (default_ttl_seconds, max_ttl_seconds; a bad statestore-ttl header is InvalidRequest)."""
    if measures.stores and not policy.threads_enabled:
        raise PolicyRefusal("threads_enabled", "storing conversations is turned off for this owner")
    if measures.session and not policy.sessions_enabled:
        raise PolicyRefusal("sessions_enabled", "sessions are turned off for this owner")
    if measures.background and policy.max_background_turns == 0:
        raise PolicyRefusal("max_background_turns", "background responses are turned off for this owner", 0)
    if measures.messages is not None and measures.messages > policy.max_messages:
        limit = policy.max_messages
        raise PolicyRefusal("max_messages", f"the conversation would exceed its limit of {limit} messages", limit)
    if measures.size is not None and measures.size > policy.max_thread_bytes:
        raise PolicyRefusal(
            "max_thread_bytes",
            f"the conversation would exceed its limit of {policy.max_thread_bytes} bytes",
            policy.max_thread_bytes,
        )
    return policy.ttl_for(measures.requested_ttl, measures.current_ttl)
