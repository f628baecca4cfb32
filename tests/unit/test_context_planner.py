"""The context planner of docs/protocol.md §9 (statestore/core/planner.py) with each door's message format: the
Messages one (threads/context.py) and the Chat Completions one the Responses door renders its items to."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from statestore.core import planner
from statestore.policy import Policy
from statestore.responses.chat_format import CHAT, split, summary_text
from statestore.responses.context import Base, chain_base, kept_after, plan
from statestore.store.response_records import ResponseRow
from statestore.threads.context import MESSAGES


def dumped(message: dict[str, Any]) -> bytes:
    return orjson.dumps(message)


def policy(strategy: str, window: int | None) -> Policy:
    return Policy(True, True, 60, 600, 1 << 20, 100, context_strategy=strategy, context_window_tokens=window)  # type: ignore[arg-type]


# Chat Completions messages, as the Responses door renders its items.
USER = dumped({"role": "user", "content": "u" * 100})
ANSWER = dumped({"role": "assistant", "content": "a" * 100})
CALLS = dumped(
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        ],
    }
)
RESULT_1 = dumped({"role": "tool", "tool_call_id": "c1", "content": "r" * 100})
RESULT_2 = dumped({"role": "tool", "tool_call_id": "c2", "content": "r" * 100})

# The same conversation in the Messages format.
M_USER = dumped({"role": "user", "content": "u" * 100})
M_CALL = dumped({"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]})
M_RESULT = dumped({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "r" * 100}]})
M_ANSWER = dumped({"role": "assistant", "content": [{"type": "text", "text": "a" * 100}]})


def test_one_window_helper_for_both_doors() -> None:
    assert planner.window_of(policy("none", 1000)) is None
    assert planner.window_of(policy("truncate", None)) is None
    assert planner.window_of(policy("summarize", 1000)) == planner.Window("summarize", 1000, 0.8, 0.5)
    # The Responses door's `truncation: "auto"` names the strategy when the policy's is none.
    assert planner.window_of(policy("none", 1000), "truncate") == planner.Window("truncate", 1000, 0.8, 0.5)
    window = planner.Window("truncate", 1000)
    assert not planner.passes_trigger(window, 800) and planner.passes_trigger(window, 801)
    assert planner.summary_budget(planner.Window("summarize", 100_000)) == 12_500
    assert planner.summary_budget(window) == 256


def test_the_estimate_uses_the_measured_ratio_else_the_default() -> None:
    assert planner.tokens_per_byte(0, 1000) == planner.DEFAULT_TOKENS_PER_BYTE
    assert planner.tokens_per_byte(1000, 0) == planner.DEFAULT_TOKENS_PER_BYTE
    assert planner.tokens_per_byte(1000, 2000) == 0.5
    assert planner.estimate(known_tokens=900, known_bytes=4000, new_bytes=400, ratio=0.5) == 900 + 200 + 1
    assert planner.estimate(known_tokens=0, known_bytes=4000, new_bytes=400, ratio=0.5) == 2000 + 200 + 1


def test_chat_boundaries_keep_a_call_with_its_results() -> None:
    late_user = dumped({"role": "user", "content": "between a call and its result"})
    run = [USER, ANSWER, CALLS, RESULT_1, RESULT_2, ANSWER, USER, CALLS, late_user, RESULT_1, USER]
    assert CHAT.boundaries(run) == [True, False, False, False, False, False, True, False, False, False, True]
    assert CHAT.boundaries([dumped({"role": "system", "content": "s"}), b"not json", USER]) == [False, False, True]


def test_messages_boundaries_are_user_turns_that_are_not_tool_results() -> None:
    assert MESSAGES.boundaries([M_USER, M_CALL, M_RESULT, M_ANSWER, M_USER]) == [True, False, False, False, True]


@pytest.mark.parametrize(
    ("fmt", "messages", "tool_results"),
    [
        (CHAT, [USER, CALLS, RESULT_1, RESULT_2, ANSWER, USER, CALLS, RESULT_1, RESULT_2, ANSWER], {2, 3, 7, 8}),
        (MESSAGES, [M_USER, M_CALL, M_RESULT, M_ANSWER, M_USER, M_CALL, M_RESULT, M_ANSWER], {2, 6}),
    ],
    ids=["chat", "messages"],
)
def test_no_cut_separates_a_call_from_its_result(fmt: Any, messages: list[bytes], tool_results: set[int]) -> None:
    user = messages[0]
    for budget in range(0, 600, 5):
        for first_new in (user, messages[sorted(tool_results)[0]]):
            cut = planner.plan_cut(
                fmt,
                messages,
                has_head=False,
                first_new=first_new,
                fixed_bytes=0,
                new_bytes=len(first_new),
                ratio=1.0,
                budget_tokens=budget,
            )
            assert cut is not None, "a later user turn is always there to move to"
            starts = messages[cut.index] if cut.index < len(messages) else first_new
            assert fmt.boundaries([starts]) == [True], (budget, cut)
            assert cut.dropped_bytes == sum(fmt.size(m) for m in messages[: cut.index])


def test_a_context_may_start_with_the_new_messages_only_when_the_first_is_a_boundary() -> None:
    messages = [USER, CALLS]
    common: dict[str, Any] = {"has_head": False, "fixed_bytes": 0, "new_bytes": 0, "ratio": 1.0, "budget_tokens": 0}
    assert planner.plan_cut(CHAT, messages, first_new=RESULT_1, **common) is None
    assert planner.plan_cut(CHAT, [USER, ANSWER], first_new=USER, **common) == planner.Cut(
        2, sum(map(CHAT.size, [USER, ANSWER]))
    )
    head = CHAT.summary_message("earlier")
    # With a head, the first stored message is a place to start: the head goes, nothing stored does.
    assert planner.plan_cut(CHAT, [head, USER, CALLS], first_new=RESULT_1, **common | {"has_head": True}) == (
        planner.Cut(1, 0)
    )


def test_the_summary_request_and_the_summary_in_each_format() -> None:
    asked = planner.summary_messages([USER, ANSWER], None)
    assert asked[:2] == [USER, ANSWER]
    assert orjson.loads(asked[2]) == {"role": "user", "content": planner.DEFAULT_SUMMARY_INSTRUCTIONS}
    assert orjson.loads(planner.summary_messages([], "Be brief.")[0])["content"] == "Be brief."
    assert orjson.loads(CHAT.summary_message("s")) == {"role": "user", "content": planner.SUMMARY_PREFIX + "s"}
    assert orjson.loads(MESSAGES.summary_message("s")) == {
        "role": "user",
        "content": [{"type": "text", "text": planner.SUMMARY_PREFIX + "s"}],
    }
    assert summary_text({"choices": [{"message": {"role": "assistant", "content": " s "}}]}) == "s"
    assert summary_text({"choices": [{"message": {"role": "assistant", "content": None}}]}) is None
    assert summary_text({"error": {}}) is None


def _row(kept: int | None, head_id: str | None = None, head: bytes | None = None) -> ResponseRow:
    return ResponseRow("resp_x", "resp_r", 3, 0, b"{}", None, 100, 400, kept, head_id, head)


def test_a_chain_continues_from_the_base_its_last_turn_left() -> None:
    joined = b",".join([USER, ANSWER, USER, ANSWER])
    tail = b",".join([USER, ANSWER])
    assert chain_base(None, joined) == Base(joined)
    assert chain_base(_row(None), joined) == Base(joined)
    head = CHAT.summary_message("s")
    assert chain_base(_row(len(tail), "resp_h", head), joined) == Base(tail, head, "resp_h", whole=False)
    assert chain_base(_row(0, "resp_h", head), joined) == Base(b"", head, "resp_h", whole=False)
    # A count that leaves no message start there (the chain's first items changed), or a head that is gone: all.
    assert chain_base(_row(len(tail) + 3), joined) == Base(joined)
    assert chain_base(_row(len(joined) + 1), joined) == Base(joined)
    assert chain_base(_row(len(tail), "resp_gone", None), joined) == Base(joined)
    assert kept_after(Base(tail), b"[new]") == len(tail) + 1 + 5
    assert kept_after(Base(b""), b"[new]") == 5


def test_the_responses_plan_summarises_what_it_drops() -> None:
    messages = [USER, ANSWER, USER, ANSWER]
    new = USER
    window = planner.Window("summarize", 200)  # trigger 160 tokens; target 100; the summary budget 256
    asked: list[tuple[list[bytes], int]] = []

    def request(summarised: list[bytes], budget: int) -> bytes:
        asked.append((summarised, budget))
        return b"summary request"

    async def summarize(body: bytes) -> str | None:
        assert body == b"summary request"
        return "earlier turns"

    moved = asyncio.run(
        plan(window, Base(b",".join(messages)), fixed_bytes=0, new=new, ratio=0.25, summary_request=request,
             summarize=summarize)
    )  # fmt: skip
    assert moved is not None and moved.action == "summarized" and not moved.summary_failed
    assert moved.base.head == CHAT.summary_message("earlier turns")
    assert asked == [(messages, 256)] and moved.base.context == b""
    # Under the trigger nothing is parsed: a context that is not JSON at all passes through.
    assert asyncio.run(
        plan(window, Base(b"not json"), fixed_bytes=0, new=new, ratio=0.25, summary_request=request,
             summarize=summarize)
    ) is None  # fmt: skip


def test_the_responses_plan_truncates_when_the_summary_fails() -> None:
    joined = b",".join([USER, ANSWER, USER, ANSWER])

    async def failing(body: bytes) -> str | None:
        return None

    moved = asyncio.run(
        plan(planner.Window("summarize", 200), Base(joined), fixed_bytes=0, new=USER, ratio=0.25,
             summary_request=lambda summarised, budget: b"", summarize=failing)
    )  # fmt: skip
    assert moved is not None and (moved.action, moved.summary_failed, moved.base.head) == ("truncated", True, None)
    assert split(moved.base.context) == [] or CHAT.boundaries(split(moved.base.context))[0]
