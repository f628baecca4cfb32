"""The echo backend's context window (statestore/upstream/echo_context.py): the API's "prompt is too long", usage from
the request's size counted from the last compaction block, and deterministic compaction for compact_20260112."""

from __future__ import annotations

from typing import Any

from statestore.upstream import echo, echo_context

EDIT = {"edits": [{"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 100}}]}


def request(messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    return {"model": "echo-1", "max_tokens": 1024, "messages": messages, **fields}


def test_a_request_over_the_window_is_refused_with_the_apis_message() -> None:
    big = request([{"role": "user", "content": "x" * 4000}])
    message = echo_context.too_long(big, 500)
    assert message is not None and message.startswith("prompt is too long: ") and message.endswith("> 500 maximum")
    assert echo_context.too_long(big, None) is None
    assert echo_context.too_long(request([{"role": "user", "content": "hi"}]), 500) is None


def test_compaction_is_deterministic_and_opens_the_reply() -> None:
    body = request([{"role": "user", "content": "tell me a long story " * 40}], context_management=EDIT)
    first, second = echo.echo_reply(body), echo.echo_reply(body)
    assert first["content"][0] == second["content"][0]
    assert first["content"][0]["type"] == "compaction" and "Compacted 1 messages" in first["content"][0]["content"]
    assert first["content"][1]["type"] == "text"
    small = request([{"role": "user", "content": "hi"}], context_management=EDIT)
    assert all(block["type"] != "compaction" for block in echo.echo_reply(small)["content"])


def test_input_is_counted_from_the_last_compaction_block() -> None:
    compacted = {
        "role": "assistant",
        "content": [{"type": "text", "text": "old " * 500}, {"type": "compaction", "content": "s"}],
    }
    history: list[dict[str, Any]] = [
        {"role": "user", "content": "y" * 8000},
        compacted,
        {"role": "user", "content": "next"},
    ]
    tokens = echo_context.input_tokens(request(history))
    assert tokens < 50
    assert echo_context.effective_messages(history)[0] == {
        "role": "assistant",
        "content": [{"type": "compaction", "content": "s"}],
    }
