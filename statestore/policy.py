"""Retention policy: what an owner may store and for how long (docs/protocol.md §5, §8)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from statestore.config import Settings
from statestore.errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class Policy:
    threads_enabled: bool
    sessions_enabled: bool
    default_ttl_seconds: int
    max_ttl_seconds: int
    max_thread_bytes: int
    max_messages: int
    # The context policy (docs/protocol.md §9); the fields and their checks are defined in statestore/policy_fields.py.
    context_strategy: Literal["none", "truncate", "summarize"] = "none"
    # "auto": the window the backend states (core/windows.py), resolved per turn before the planner sees it.
    context_window_tokens: int | Literal["auto"] | None = None
    context_trigger_ratio: float = 0.8
    context_target_ratio: float = 0.5
    summary_model: str | None = None
    summary_instructions: str | None = None
    # Background responses queued or running at once per owner (docs/responses.md, "Bounds").
    max_background_turns: int = 16
    # How long a write's outcome is kept under its Idempotency-Key (docs/protocol.md §11).
    idempotency_ttl_seconds: int = 86_400

    @classmethod
    def from_settings(cls, settings: Settings) -> Policy:
        return cls(
            threads_enabled=settings.threads_enabled,
            sessions_enabled=settings.sessions_enabled,
            default_ttl_seconds=settings.default_ttl_seconds,
            max_ttl_seconds=settings.max_ttl_seconds,
            max_thread_bytes=settings.max_thread_bytes,
            max_messages=settings.max_messages,
        )

    def ttl_for(self, requested: bytes | None, current: int | None) -> int:
        """The TTL a turn gets: the `statestore-ttl` header clamped to the maximum, else the thread's own, else the
        default; a thread whose TTL was lowered by policy gets the lower one on its next use."""
        if requested is not None:
            text = requested.decode("latin-1").strip()
            if not text.isascii() or not text.isdigit() or int(text[:12]) < 1:
                raise InvalidRequest("statestore-ttl must be a whole number of seconds, at least 1")
            # Anything longer than 12 digits is beyond every maximum; int() of thousands of digits is refused anyway.
            return self.max_ttl_seconds if len(text) > 12 else min(int(text), self.max_ttl_seconds)
        return min(current if current is not None else self.default_ttl_seconds, self.max_ttl_seconds)
