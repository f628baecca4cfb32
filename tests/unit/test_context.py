"""docs/protocol.md §9's pure rules: where a base may move, one step down to the target, compaction heads, the policy
fields."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import orjson
import pytest

from statestore.core import context_move, planner
from statestore.policy_fields import POLICY_FIELDS, PolicyValueError, validate_values
from statestore.store.turn_records import LeasedThread, TurnUsage
from statestore.threads import context


def row(message: dict[str, Any]) -> bytes:
    return orjson.dumps(message)


def user(text: str) -> bytes:
    return row({"role": "user", "content": text})


def reply(text: str) -> bytes:
    return row({"role": "assistant", "content": [{"type": "text", "text": text}]})


TOOL_CALL = row({"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]})
TOOL_RESULT = row({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]})


def plan(rows: list[tuple[int, bytes]], budget: float, *, first_new_is_boundary: bool = True) -> context.Cut | None:
    """The truncating step a thread's turn takes (core/context_move.py), over its rows as stored, with a window whose
    target is `budget`."""
    head_position = max((position for position, _ in rows), default=-1) + 1
    moved = asyncio.run(
        context_move.summarize_or_truncate(
            planner.Window("truncate", int(budget * 2)),
            context.MESSAGES,
            [body for _, body in rows],
            has_head=bool(rows) and rows[0][0] < 0,
            first_new=context.first_new_stand_in(first_new_is_boundary),
            fixed_bytes=0,
            new_bytes=0,
            ratio=1.0,
            ask_summary=None,
        )
    )
    if moved is None:
        return None
    return context.Cut(context.position_at(rows, moved.cut.index, head_position), moved.cut.dropped_bytes)


def test_a_boundary_is_a_user_message_that_is_not_a_tool_result() -> None:
    assert context.is_boundary(user("hi"))
    assert context.is_boundary(row({"role": "user", "content": [{"type": "text", "text": "hi"}]}))
    assert not context.is_boundary(TOOL_RESULT)
    assert not context.is_boundary(reply("hi"))
    assert not context.is_boundary(row({"role": "system", "content": []}))


def test_truncate_moves_to_the_earliest_boundary_under_the_target() -> None:
    rows = list(enumerate([user("a" * 100), reply("b" * 100), user("c" * 100), reply("d" * 100), user("e")]))
    sizes = [len(body) for _, body in rows]
    # Everything from position 2 on fits, from 0 does not: the earliest boundary that fits is 2.
    cut = plan(rows, budget=sum(sizes[2:]))
    assert cut == context.Cut(2, sum(sizes[:2]))


def test_truncate_never_separates_a_tool_use_from_its_tool_result() -> None:
    rows = list(enumerate([user("go"), TOOL_CALL, TOOL_RESULT, reply("done"), user("next")]))
    for budget in range(0, 400, 7):
        cut = plan(rows, budget=budget)
        assert cut is not None and cut.position in (4, 5), "only user turns that are not tool results start a context"


def test_without_any_boundary_nothing_moves() -> None:
    rows = list(enumerate([user("go"), TOOL_CALL]))
    assert plan(rows, budget=0, first_new_is_boundary=False) is None


def test_a_head_may_go_while_the_base_stays() -> None:
    head = row({"role": "assistant", "content": [{"type": "compaction", "content": "earlier"}]})
    rows = [(-1, head), (10, user("x")), (11, reply("y"))]
    assert plan(rows, budget=len(user("x")) + len(reply("y"))) == context.Cut(10, 0)


def test_when_nothing_fits_the_latest_boundary_is_taken() -> None:
    rows = list(enumerate([user("a" * 100), reply("b" * 100)]))
    assert plan(rows, budget=0) == context.Cut(2, sum(len(body) for _, body in rows))


def test_compaction_head_cuts_the_reply_to_its_last_compaction_block() -> None:
    content = [
        {"type": "text", "text": "before"},
        {"type": "compaction", "content": "summary", "signature": "s"},
        {"type": "text", "text": "after"},
    ]
    head = context.compaction_head(content)
    assert head is not None and orjson.loads(head) == {"role": "assistant", "content": content[1:]}
    assert context.compaction_head([{"type": "compaction", "content": None}]) is None
    assert context.compaction_head([{"type": "text", "text": "x"}]) is None


def test_the_estimate_uses_the_measured_ratio() -> None:
    leased = LeasedThread(
        id="thr_x",
        session_id=None,
        system=None,
        tools=None,
        system_fp=None,
        tools_fp=None,
        output_config_fp=None,
        fixed_markers=0,
        head_position=10,
        byte_count=8000,
        ttl_seconds=60,
        context_tokens=1000,
    )
    assert context.tokens_per_byte(leased, 0) == 1000 / 8000
    assert context.estimate(leased, 0, 800) == 1000 + 100 + 1
    assert context.total_tokens(TurnUsage(1, 2, 3, 4)) == 10


def valid(**changes: Any) -> dict[str, Any]:
    values = {
        "threads_enabled": True,
        "sessions_enabled": True,
        "default_ttl_seconds": 60,
        "max_ttl_seconds": 600,
        "max_thread_bytes": 1 << 20,
        "max_messages": 100,
    }
    return values | changes


def test_policy_fields_fill_in_their_defaults() -> None:
    checked = validate_values(valid())
    assert set(checked) == {field.name for field in POLICY_FIELDS}
    assert (checked["context_strategy"], checked["context_trigger_ratio"], checked["context_target_ratio"]) == (
        "none",
        0.8,
        0.5,
    )


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"context_strategy": "truncate"}, "context_window_tokens"),
        ({"context_trigger_ratio": math.nan}, "context_trigger_ratio"),
        ({"context_trigger_ratio": math.inf}, "context_trigger_ratio"),
        ({"context_target_ratio": 0.8}, "context_target_ratio"),
        ({"context_window_tokens": 10}, "context_window_tokens"),
        ({"summary_model": ""}, "summary_model"),
        ({"max_messages": 1}, "max_messages"),
    ],
)
def test_policy_values_are_checked_naming_the_field(changes: dict[str, Any], named: str) -> None:
    with pytest.raises(PolicyValueError, match=named):
        validate_values(valid(**changes))


def test_the_policy_record_and_its_field_definitions_agree() -> None:
    """statestore/policy_fields.py defines the fields; Policy's type hints, which the console's forms read, match."""
    import dataclasses

    from statestore.admin import policy_fields
    from statestore.policy import Policy

    assert [f.name for f in dataclasses.fields(Policy)] == [f.name for f in POLICY_FIELDS]
    form_kinds = {"bool": "bool", "int": "int", "ratio": "float", "choice": "choice", "text": "str"}
    for spec, shown in zip(POLICY_FIELDS, policy_fields(), strict=True):
        words = ("auto",) if spec.auto else spec.choices
        assert (shown.kind, shown.optional, shown.choices) == (form_kinds[spec.kind], spec.nullable, words)
