"""The context planner of docs/protocol.md §9, for both doors: the estimate, the window the policy manages, the trigger,
where to cut, and the summary request's messages. It knows nothing of a message format: a `MessageFormat` (the
Messages door's in threads/context.py, the Chat Completions one in responses/chat_format.py) says how big a stored
message is, where a context may start, and how a summary reads as a message.

Pure functions over bytes; the caller loads what it needs. Only a turn whose estimate passes the trigger hands the
planner its stored messages, so every other turn stays a join of stored bytes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal, Protocol

import orjson

from statestore.policy import Policy

# Tokens per byte when nothing is measured yet: the usual ratio for English text in JSON.
DEFAULT_TOKENS_PER_BYTE = 0.25
SUMMARY_PREFIX = "Summary of the earlier part of this conversation:\n\n"
DEFAULT_SUMMARY_INSTRUCTIONS = (
    "Summarise the conversation above so that it can continue without it: the user's goals, the decisions made, "
    "facts and numbers established, tool results that still matter, and open questions. Write only the summary."
)

Strategy = Literal["truncate", "summarize"]


class MessageFormat(Protocol):
    """What the planner needs to know of a door's stored messages (canonical JSON bytes, one message each)."""

    def size(self, message: bytes) -> int:
        """The bytes the message takes in a joined context (with its separator, where the format counts one)."""
        ...

    def boundaries(self, messages: Sequence[bytes]) -> list[bool]:
        """For each message, in order: whether a context may start there without separating a tool call from its
        result. Told the whole run, since in some formats that depends on what came before."""
        ...

    def summary_message(self, text: str) -> bytes:
        """A summary as the opening user message of a context, in this format."""
        ...


@dataclass(frozen=True, slots=True)
class Window:
    """The part of a policy the planner applies to one turn: the strategy, the window and its two ratios."""

    strategy: Strategy
    tokens: int
    trigger_ratio: float = 0.8
    target_ratio: float = 0.5

    @property
    def trigger_tokens(self) -> float:
        return self.trigger_ratio * self.tokens

    @property
    def target_tokens(self) -> float:
        return self.target_ratio * self.tokens


def window_of(policy: Policy, strategy: str | None = None) -> Window | None:
    """The window the policy manages with `strategy` (by default the policy's own), or None when the context is
    forwarded as rebuilt: strategy `none`, or no window to manage."""
    chosen = policy.context_strategy if strategy is None else strategy
    tokens = policy.context_window_tokens
    # "auto" is resolved to what the backend states before a turn plans (resolved_window); unresolved, it is unknown.
    if chosen not in ("truncate", "summarize") or not isinstance(tokens, int) or not tokens:
        return None
    kind: Strategy = "summarize" if chosen == "summarize" else "truncate"
    return Window(kind, tokens, policy.context_trigger_ratio, policy.context_target_ratio)


def resolved_window(policy: Policy, discovered: int | None) -> Policy:
    """The policy with an `auto` window replaced by the one the backend states (None while it is unknown)."""
    if policy.context_window_tokens != "auto":
        return policy
    return replace(policy, context_window_tokens=discovered)


def window_after_refusal(
    policy: Policy, window: Window | None, stated: int | None, strategy: str | None = None
) -> Window | None:
    """The window a refused turn is cut to (docs/protocol.md §9, "A backend's own refusal"): the one the turn
    managed, narrowed to what the refusal stated; or, when the turn had no window yet (`auto`, not yet known), the
    stated one under the policy's strategy. None when the policy does not manage the context."""
    if window is not None:
        return replace(window, tokens=min(window.tokens, stated)) if stated else window
    if stated is None:
        return None
    return window_of(replace(policy, context_window_tokens=stated), strategy)


def tokens_per_byte(measured_tokens: int, measured_bytes: int) -> float:
    """The conversation's own ratio, from the backend's usage after the last turn and the bytes it counted."""
    if measured_tokens > 0 and measured_bytes > 0:
        return measured_tokens / measured_bytes
    return DEFAULT_TOKENS_PER_BYTE


def estimate(*, known_tokens: int, known_bytes: int, new_bytes: int, ratio: float) -> int:
    """The next request's size in tokens: what the backend counted of the context after the last turn (when the
    same bytes go again), else `known_bytes` at the ratio, plus the bytes added since at the ratio."""
    known = known_tokens or int(known_bytes * ratio)
    return known + int(new_bytes * ratio) + 1


def passes_trigger(window: Window, estimated_tokens: int) -> bool:
    return estimated_tokens > window.trigger_tokens


def summary_budget(window: Window) -> int:
    """max_tokens of a summary request: a quarter of what the context is brought down to, at least 256."""
    return max(256, int(window.target_tokens / 4))


@dataclass(frozen=True, slots=True)
class Cut:
    """Where a context starts after a move: `messages[index:]` stay (index == len(messages): none stay, the context
    starts with the turn's new messages); `dropped_bytes` is the size of what goes, a head excluded."""

    index: int
    dropped_bytes: int


def plan_cut(
    fmt: MessageFormat,
    messages: Sequence[bytes],
    *,
    has_head: bool,
    first_new: bytes | None,
    fixed_bytes: int,
    new_bytes: int,
    ratio: float,
    budget_tokens: float,
) -> Cut | None:
    """The earliest boundary that brings the request under `budget_tokens`, in one step (docs/protocol.md §9); the
    latest boundary when none does; None when there is no boundary to move to. `messages` is the context as it stands
    (its head first when `has_head`); `first_new` the turn's first new message, a place to start only when it is a
    boundary itself."""
    stored_from = 1 if has_head else 0
    run = [*messages, first_new] if first_new is not None else list(messages)
    flags = fmt.boundaries(run)
    sizes = [fmt.size(message) for message in messages]
    candidates: list[tuple[int, int, int]] = []  # (index, bytes kept from there, stored bytes dropped before it)
    kept = sum(sizes[stored_from:])
    dropped = 0
    for index in range(stored_from, len(messages)):
        # The first stored message is a place to move to only when a head stands before it (the head goes).
        if (index > stored_from or has_head) and flags[index]:
            candidates.append((index, kept, dropped))
        kept -= sizes[index]
        dropped += sizes[index]
    if first_new is not None and flags[len(messages)] and messages:
        candidates.append((len(messages), 0, dropped))
    if not candidates:
        return None
    for index, kept_bytes, dropped_bytes in candidates:
        if (fixed_bytes + kept_bytes + new_bytes) * ratio <= budget_tokens:
            return Cut(index, dropped_bytes)
    index, _, dropped_bytes = candidates[-1]
    return Cut(index, dropped_bytes)


def summary_messages(summarised: Sequence[bytes], instructions: str | None) -> list[bytes]:
    """The messages of a summary request: the ones to summarise, as stored (so the request shares the prompt
    cache's prefix with the turns before), then the instructions as the last user message; the door adds its own
    system and tools, `max_tokens` (`summary_budget`) and the model (`summary_model`, else the turn's)."""
    ask = orjson.dumps({"role": "user", "content": instructions or DEFAULT_SUMMARY_INSTRUCTIONS})
    return [*summarised, ask]
