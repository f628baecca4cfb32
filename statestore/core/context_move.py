"""The one summarise-or-truncate step of docs/protocol.md §9, for both doors: past the trigger, where a context starts
moves in one step to the earliest tool-safe boundary that brings the estimate under the target; under `summarize`,
what is dropped is summarised first (the cut then leaves the summary's budget free), and a summary that fails
truncates instead. The door hands over its message format, the context as stored messages (its head first) and how
it asks for a summary, and translates the move back into its own terms (a thread's base position, a chain's base)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from statestore.core import planner

# Asks the backend for a summary of these messages in at most this many tokens: its text, or None when it failed.
AskSummary = Callable[[list[bytes], int], Awaitable[str | None]]


@dataclass(frozen=True, slots=True)
class ContextCut:
    """Where the context starts after the step (`messages[cut.index:]` stay), and the summary that opens it, if any."""

    cut: planner.Cut
    summary: str | None
    summary_failed: bool  # a summary was asked for and failed: the context was truncated instead


async def summarize_or_truncate(
    window: planner.Window,
    fmt: planner.MessageFormat,
    messages: Sequence[bytes],
    *,
    has_head: bool,
    first_new: bytes | None,
    fixed_bytes: int,
    new_bytes: int,
    ratio: float,
    ask_summary: AskSummary | None,
) -> ContextCut | None:
    """The move of a context already past its trigger (or refused as too long), or None when there is no boundary to
    move to. `ask_summary` None: the turn truncates whatever the window's strategy (a count, or no backend to ask)."""

    def cut_under(budget: float) -> planner.Cut | None:
        return planner.plan_cut(
            fmt,
            messages,
            has_head=has_head,
            first_new=first_new,
            fixed_bytes=fixed_bytes,
            new_bytes=new_bytes,
            ratio=ratio,
            budget_tokens=budget,
        )

    if window.strategy == "summarize" and ask_summary is not None:
        budget = planner.summary_budget(window)
        cut = cut_under(window.target_tokens - budget)
        if cut is None:
            return None
        summary = await ask_summary(list(messages[: cut.index]), budget)
        if summary is not None:
            return ContextCut(cut, summary, summary_failed=False)
        cut = cut_under(window.target_tokens)
        return ContextCut(cut, None, summary_failed=True) if cut is not None else None
    cut = cut_under(window.target_tokens)
    return ContextCut(cut, None, summary_failed=False) if cut is not None else None
