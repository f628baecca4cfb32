"""The one summarise-or-truncate step (statestore/core/context_move.py), as each door calls it: with the Messages
format (a thread's stored rows) and with the Chat Completions format (a chain's rendered items)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from statestore.core import planner
from statestore.core.context_move import ContextCut, summarize_or_truncate
from statestore.responses.chat_format import CHAT
from statestore.threads.context import MESSAGES


def dumped(message: dict[str, Any]) -> bytes:
    return orjson.dumps(message)


# The same exchange in each door's format: user, a tool call, its result, an answer, user, answer.
CHAT_RUN = [
    dumped({"role": "user", "content": "u" * 100}),
    dumped(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        }
    ),
    dumped({"role": "tool", "tool_call_id": "c1", "content": "r" * 100}),
    dumped({"role": "assistant", "content": "a" * 100}),
    dumped({"role": "user", "content": "v" * 100}),
    dumped({"role": "assistant", "content": "b" * 100}),
]
MESSAGES_RUN = [
    dumped({"role": "user", "content": "u" * 100}),
    dumped({"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}),
    dumped({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "r" * 100}]}),
    dumped({"role": "assistant", "content": [{"type": "text", "text": "a" * 100}]}),
    dumped({"role": "user", "content": "v" * 100}),
    dumped({"role": "assistant", "content": [{"type": "text", "text": "b" * 100}]}),
]
DOORS = [pytest.param(MESSAGES, MESSAGES_RUN, id="messages"), pytest.param(CHAT, CHAT_RUN, id="responses")]


def step(
    fmt: planner.MessageFormat,
    run: list[bytes],
    strategy: planner.Strategy,
    tokens: int,
    answer: str | None,
    asked: list[tuple[list[bytes], int]],
    *,
    can_ask: bool = True,
    first_new: bytes | None = None,
) -> ContextCut | None:
    async def ask(summarised: list[bytes], budget: int) -> str | None:
        asked.append((summarised, budget))
        return answer

    return asyncio.run(
        summarize_or_truncate(
            planner.Window(strategy, tokens),
            fmt,
            run,
            has_head=False,
            first_new=first_new or run[4],
            fixed_bytes=0,
            new_bytes=len(first_new or run[4]),
            ratio=0.25,
            ask_summary=ask if can_ask else None,
        )
    )


@pytest.mark.parametrize(("fmt", "run"), DOORS)
def test_truncate_moves_to_the_earliest_boundary_under_the_target_and_asks_nothing(
    fmt: planner.MessageFormat, run: list[bytes]
) -> None:
    asked: list[tuple[list[bytes], int]] = []
    # Target 150 tokens = 600 bytes at 0.25: the tool result is no place to start, the second user message is.
    moved = step(fmt, run, "truncate", 300, "never asked", asked)
    assert moved == ContextCut(planner.Cut(4, sum(fmt.size(m) for m in run[:4])), None, summary_failed=False)
    assert asked == []


@pytest.mark.parametrize(("fmt", "run"), DOORS)
def test_summarize_asks_for_what_it_drops_within_the_budget(fmt: planner.MessageFormat, run: list[bytes]) -> None:
    asked: list[tuple[list[bytes], int]] = []
    # Target 1,000 tokens less the summary's budget of 256 leaves room for all from the first boundary after it.
    moved = step(fmt, run, "summarize", 2000, "what was said", asked)
    assert moved is not None and moved.summary == "what was said" and not moved.summary_failed
    assert asked == [(run[: moved.cut.index], 256)]
    assert fmt.boundaries(run)[moved.cut.index]


@pytest.mark.parametrize(("fmt", "run"), DOORS)
def test_a_failed_summary_truncates_to_the_target_and_says_so(fmt: planner.MessageFormat, run: list[bytes]) -> None:
    asked: list[tuple[list[bytes], int]] = []
    moved = step(fmt, run, "summarize", 300, None, asked)
    truncated = step(fmt, run, "truncate", 300, None, [])
    assert truncated is not None and moved == ContextCut(truncated.cut, None, summary_failed=True)
    assert len(asked) == 1


@pytest.mark.parametrize(("fmt", "run"), DOORS)
def test_summarize_without_a_backend_to_ask_truncates_without_failing(
    fmt: planner.MessageFormat, run: list[bytes]
) -> None:
    moved = step(fmt, run, "summarize", 300, "unused", [], can_ask=False)
    assert moved == step(fmt, run, "truncate", 300, None, [])


@pytest.mark.parametrize(("fmt", "run"), DOORS)
def test_no_boundary_to_move_to_is_no_move(fmt: planner.MessageFormat, run: list[bytes]) -> None:
    asked: list[tuple[list[bytes], int]] = []
    # Only the first message is a boundary, nothing stands before it to drop, and the new message (an answer) is none.
    assert step(fmt, run[:3], "summarize", 300, "unused", asked, first_new=run[5]) is None and asked == []
