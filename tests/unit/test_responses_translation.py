"""The Responses front door's pure parts: input items checked and rendered, joins of stored bytes, the chunk
translator's event sequence, and truncation: "auto"."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from statestore.core import planner
from statestore.policy import Policy
from statestore.responses.context import Base, plan, window_for
from statestore.responses.errors import BadRequest
from statestore.responses.items import join_rendered, join_segments, stored
from statestore.responses.request import chat_body, read_turn
from statestore.responses.stream import ChunkTranslator


def _input(items: object) -> list[dict[str, object]]:
    """`input` as a turn's body carries it, read by the request model."""
    return read_turn(orjson.dumps({"model": "m", "input": items})).input


def _messages(items: list[dict[str, object]]) -> list[object]:
    joined = join_rendered((s.kind, s.rendered) for s in (stored(i) for i in _input(items)))
    parsed: list[object] = orjson.loads(b"[" + joined + b"]")
    return parsed


def test_consecutive_calls_join_one_assistant_message_and_reasoning_is_not_sent() -> None:
    assert _messages(
        [
            {"type": "reasoning", "summary": []},
            {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "b", "name": "g", "arguments": "[]"},
            {"type": "function_call_output", "call_id": "a", "output": "1"},
            {"type": "function_call_output", "call_id": "b", "output": [{"type": "input_text", "text": "2"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
        ]
    ) == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "b", "type": "function", "function": {"name": "g", "arguments": "[]"}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "1"},
        {"role": "tool", "tool_call_id": "b", "content": "2"},
        {"role": "assistant", "content": "done"},
    ]


def test_ids_a_client_sends_back_are_kept_and_missing_ones_minted() -> None:
    items = _input(
        [
            {
                "type": "function_call",
                "id": "fc_given",
                "status": "completed",
                "call_id": "c",
                "name": "f",
                "arguments": "",
            },
            {"role": "user", "content": "hi"},
        ]
    )
    assert items[0]["id"] == "fc_given" and str(items[1]["id"]).startswith("msg_")


@pytest.mark.parametrize(
    "bad",
    [
        [{"type": "item_reference", "id": "x"}],
        [{"role": "user", "content": []}],
        [{"role": "assistant", "content": [{"type": "input_image", "image_url": "u"}]}],
        [{"type": "function_call_output", "call_id": "c", "output": 3}],
        [{"role": "user", "content": "x", "status": "weird"}],
        ["just a string"],
    ],
)
def test_bad_items_are_refused_with_the_field_named(bad: object) -> None:
    with pytest.raises(BadRequest) as refused:
        _input(bad)
    assert refused.value.param is not None and refused.value.param.startswith("input[0]")


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"model": "m", "input": "x", "store": "true"}, "store", "invalid_value"),
        ({"model": "m", "input": "x", "stream": 1}, "stream", "invalid_value"),
        ({"model": "m", "input": "x", "max_output_tokens": 5.0}, "max_output_tokens", "invalid_value"),
        ({"model": "m", "input": "x", "zeta": 1, "alpha": 2, "temperature": 9}, "alpha", "unknown_parameter"),
        ({"model": "m", "input": "x", "metadata": {"k" * 65: "v"}}, "metadata", "invalid_value"),
        ({"model": "m", "input": "x", "tool_choice": {"type": "function"}}, "tool_choice", "invalid_value"),
        ({"model": "m", "input": "x", "tools": [{"type": "function", "name": ""}]}, "tools[0].name", "invalid_value"),
        ({"model": "m", "input": [{"role": "user", "content": "x", "status": "weird"}]}, "input[0].status", None),
        (
            {"model": "m", "input": [{"role": "assistant", "content": [{"type": "refusal"}]}]},
            "input[0].content[0].refusal",
            "missing_required_parameter",
        ),
        (
            {"model": "m", "input": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]},
            "input[0].content[0]",
            "unsupported_value",
        ),
        ({"model": "m", "input": [{"id": "x"}]}, "input[0]", "unsupported_value"),
    ],
)
def test_the_request_model_names_the_field_at_fault(
    body: dict[str, object], param: str | None, code: str | None
) -> None:
    with pytest.raises(BadRequest) as refused:
        read_turn(orjson.dumps(body))
    if param is None:  # a field missing inside a part
        assert refused.value.param == "input[0].content[0].refusal"
        assert refused.value.code == "missing_required_parameter"
        return
    assert refused.value.param == param
    assert code is None or refused.value.code == code


@pytest.mark.parametrize(
    ("role", "part", "named"),
    [
        ("user", {"type": "input_file", "file_id": "file_1"}, "an input_text or input_image part expected"),
        ("assistant", {"type": "input_image", "image_url": "u"}, "an output_text or refusal part expected"),
    ],
)
def test_a_refused_part_says_which_parts_the_message_takes(role: str, part: dict[str, str], named: str) -> None:
    with pytest.raises(BadRequest) as refused:
        read_turn(orjson.dumps({"model": "m", "input": [{"role": role, "content": [part]}]}))
    assert refused.value.param == "input[0].content[0]"
    assert refused.value.code == "unsupported_value"
    assert named in str(refused.value.message)


def test_a_valid_body_is_a_turn_as_it_was_sent() -> None:
    turn = read_turn(
        orjson.dumps(
            {
                "model": "m",
                "input": [
                    {"role": "assistant", "content": "before", "extra": "ignored"},
                    {"role": "user", "content": "now"},
                ],
                "conversation": {"id": "conv_1"},
                "store": None,
                "metadata": {"user_id": "u"},
                "tool_choice": {"type": "function", "name": "f"},
                "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}},
                "temperature": 1,
            }
        )
    )
    assert (turn.conversation_id, turn.store, turn.stream, turn.metadata) == ("conv_1", True, False, {"user_id": "u"})
    assert turn.input[0]["content"] == [{"type": "output_text", "text": "before", "annotations": [], "logprobs": []}]
    assert turn.input[1]["content"] == [{"type": "input_text", "text": "now"}]
    assert turn.echo["tool_choice"] == {"type": "function", "name": "f"}
    assert turn.chat_params["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert turn.chat_params["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "n", "schema": {"type": "object"}},
    }
    assert turn.chat_params["temperature"] == 1


def test_a_text_input_is_the_user_message_item_a_list_would_make() -> None:
    """The string form is read without building its models: it must be exactly the item the list form makes."""
    from_text = read_turn(orjson.dumps({"model": "m", "input": "hi ☕"})).input
    from_list = read_turn(orjson.dumps({"model": "m", "input": [{"role": "user", "content": "hi ☕"}]})).input
    assert [dict(item, id="") for item in from_text] == [dict(item, id="") for item in from_list]
    assert from_text[0]["id"].startswith("msg_") and from_text[0]["id"] != from_list[0]["id"]


def test_an_id_looks_minted_only_with_its_prefix_and_32_base62_characters() -> None:
    from statestore.responses.ids import looks_like, new_id

    minted = new_id("resp_")
    assert looks_like("resp_", minted)
    for other in (
        "conv_" + minted[5:],
        minted[:-1],
        minted + "x",
        minted[:-1] + "-",
        minted[:-1] + "é",
        minted[:-1] + "٣",
    ):
        assert not looks_like("resp_", other), other
    assert not looks_like("resp_", None)


def test_the_backend_body_splices_the_joined_messages_in() -> None:
    turn = read_turn(
        orjson.dumps(
            {"model": "m", "input": "hi", "max_output_tokens": 5, "tools": [{"type": "function", "name": "f"}]}
        )
    )
    body = orjson.loads(chat_body(turn.chat_params, [b'{"role":"user","content":"hi"}'], stream=True))
    assert body == {
        "model": "m",
        "max_tokens": 5,
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "hi"}],
    }
    assert join_segments([b"", b"1", b"", b"2"]) == b"1,2"
    # the system message, the context and the new input as segments: empty ones take no comma
    spliced = chat_body({"model": "m"}, [b"", b'{"a":1},{"b":2}', b"", b'{"c":3}'], stream=False)
    assert orjson.loads(spliced)["messages"] == [{"a": 1}, {"b": 2}, {"c": 3}]
    assert orjson.loads(chat_body({"model": "m"}, [b"", b""], stream=False))["messages"] == []


def _chunk(delta: dict[str, object], finish: str | None = None) -> bytes:
    return orjson.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def test_chunks_become_a_well_formed_event_sequence() -> None:
    translator = ChunkTranslator()
    events = []
    for data in (
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"content": "Hel"}),
        _chunk({"content": "lo"}),
        _chunk({"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "f", "arguments": ""}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": ":1}"}}]}),
        _chunk({}, "tool_calls"),
        orjson.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}),
        b"[DONE]",
    ):
        events += translator.feed(data)
    assert translator.complete
    closing, output, status, incomplete, usage = translator.finish()
    kinds = [e["type"] for e in events + closing]
    assert kinds == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert [o["type"] for o in output] == ["message", "function_call"]
    assert output[0]["content"][0]["text"] == "Hello" and output[1]["arguments"] == '{"a":1}'
    assert output[1]["call_id"] == "call_1" and status == "completed" and incomplete is None
    assert (usage["input_tokens"], usage["output_tokens"], usage["total_tokens"]) == (3, 2, 5)


def test_a_stream_without_its_end_is_not_complete() -> None:
    translator = ChunkTranslator()
    translator.feed(_chunk({"content": "x"}, "stop"))
    assert not translator.complete  # no [DONE]


def _context(n: int) -> bytes:
    pieces = []
    for i in range(n):
        pieces += [
            orjson.dumps({"role": "user", "content": f"u{i}" * 10}),
            orjson.dumps({"role": "assistant", "content": "a" * 30}),
        ]
    return b",".join(pieces)


def _policy(window: int | None, strategy: str = "none") -> Policy:
    return Policy(True, True, 60, 600, 1 << 20, 100, context_strategy=strategy, context_window_tokens=window)  # type: ignore[arg-type]


def _truncated(context: bytes, new: bytes, window: planner.Window | None) -> bytes | None:
    def no_summary(summarised: list[bytes], budget: int) -> bytes:
        raise AssertionError("a truncation asks for no summary")

    moved = asyncio.run(
        plan(
            window,
            Base(context),
            fixed_bytes=0,
            new=new,
            ratio=planner.DEFAULT_TOKENS_PER_BYTE,
            summary_request=no_summary,
            summarize=None,
        )
    )
    return None if moved is None else moved.base.context


def test_truncation_auto_cuts_at_a_user_message_in_one_step() -> None:
    context = _context(20)
    new = orjson.dumps({"role": "user", "content": "n"})
    assert window_for(_policy(10), "disabled", on_conversation=False) is None
    assert window_for(_policy(None), "auto", on_conversation=False) is None
    assert _truncated(context, new, window_for(_policy(100_000), "auto", on_conversation=False)) is None
    # the whole context is about 100% of the window: past the 80% trigger
    window = window_for(_policy(len(context) // 4), "auto", on_conversation=False)
    assert window is not None and window.strategy == "truncate"
    cut = _truncated(context, new, window)
    assert cut is not None and context.endswith(cut) and cut.startswith(b'{"role":"user"')
    sent = len(cut) + 1 + len(new)
    assert sent / 4 <= window.target_tokens
    # the earliest boundary that fits: one more message would not
    kept = orjson.loads(b"[" + cut + b"]")
    assert len(kept) % 2 == 0 and (sent + 90) / 4 > window.target_tokens
