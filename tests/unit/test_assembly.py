"""The rebuild (statestore/threads/assembly.py) against the official SDK (anthropic 2.14.0), docs/protocol.md §2 and §3.

The reference for "the full request with earlier turns' markers removed" is what the SDK's thread helper sends when it
replays a thread: `without_cache_control` over the messages up to the last reply, the new turn as given. Strategies
track how many block markers they place, which is the reference for `count_cache_markers`.
"""

from __future__ import annotations

import copy
from typing import Any, cast

import orjson
import pytest
from anthropic.lib.threads import _thread_state as sdk
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statestore.threads import assembly

# Keys under which blocks live (the SDK follows them) and keys that only look like it inside free-form data.
TRICKY_KEYS = ("cache_control", "content", "source", "tool", "definition", "tool_references", "type", "text")
MARKERS: list[dict[str, Any]] = [
    {"type": "ephemeral"},
    {"type": "ephemeral", "ttl": "1h"},
    {"type": "ephemeral", "ttl": "5m"},
]

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# The central property gets more examples.
THOROUGH = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- strategies ------------------------------------------------------------------------------------------------------

# orjson writes integers up to 64 bits and finite floats only; both round-trip exactly.
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
json_values: st.SearchStrategy[Any] = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.sampled_from(TRICKY_KEYS) | st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=12,
)
# Free-form objects (a tool's input, a JSON schema) that may hold "cache_control" keys at any depth: never markers.
free_form = st.dictionaries(st.sampled_from(TRICKY_KEYS) | st.text(max_size=6), json_values, max_size=4)
texts = st.text(max_size=20) | st.sampled_from(['quote " backslash \\', "naïve — 東京 🚀", "\u2028\x00\n", "</x>"])

Counted = tuple[Any, int]  # a value and how many block markers it carries


@st.composite
def marked(draw: st.DrawFn, block: dict[str, Any], markers: int = 0) -> Counted:
    """`block` with perhaps a marker (or an explicit null one, which is no marker), at the end or the front."""
    choice = draw(st.sampled_from(["none", "none", "marker", "null"]))
    if choice == "none":
        return block, markers
    value = None if choice == "null" else copy.deepcopy(draw(st.sampled_from(MARKERS)))
    block = {"cache_control": value, **block} if draw(st.booleans()) else {**block, "cache_control": value}
    return block, markers + (value is not None)


@st.composite
def text_block(draw: st.DrawFn) -> Counted:
    block: dict[str, Any] = {"type": "text", "text": draw(texts)}
    if draw(st.booleans()):
        block["citations"] = None
    return draw(marked(block))


@st.composite
def image_block(draw: st.DrawFn) -> Counted:
    source: dict[str, Any] = draw(
        st.sampled_from(
            [
                {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
                {"type": "url", "url": "https://example.com/cat.png"},
            ]
        )
    )
    source, inner = draw(marked(dict(source)))  # the SDK follows "source", so a marker there counts too
    return draw(marked({"type": "image", "source": source}, inner))


@st.composite
def document_block(draw: st.DrawFn) -> Counted:
    """A document whose source holds content blocks: markers two levels down."""
    parts = draw(st.lists(text_block(), min_size=1, max_size=2))
    source = {"type": "content", "content": [part for part, _ in parts]}
    return draw(marked({"type": "document", "source": source}, sum(n for _, n in parts)))


@st.composite
def tool_use_block(draw: st.DrawFn) -> Counted:
    block = {"type": "tool_use", "id": f"toolu_{draw(st.integers(0, 999))}", "name": "lookup", "input": draw(free_form)}
    return draw(marked(block))


@st.composite
def tool_result_block(draw: st.DrawFn) -> Counted:
    block: dict[str, Any] = {"type": "tool_result", "tool_use_id": f"toolu_{draw(st.integers(0, 999))}"}
    inner = 0
    shape = draw(st.sampled_from(["absent", "string", "blocks"]))
    if shape == "string":
        block["content"] = draw(texts)
    elif shape == "blocks":
        nested = draw(st.lists(text_block() | image_block(), max_size=3))
        block["content"] = [part for part, _ in nested]
        inner = sum(n for _, n in nested)
    if draw(st.booleans()):
        block["is_error"] = draw(st.booleans())
    return draw(marked(block, inner))


@st.composite
def thinking_block(draw: st.DrawFn) -> Counted:
    if draw(st.booleans()):
        return {"type": "redacted_thinking", "data": draw(st.text(max_size=16))}, 0
    return {"type": "thinking", "thinking": draw(texts), "signature": draw(st.text(min_size=1, max_size=16))}, 0


@st.composite
def tool_addition_block(draw: st.DrawFn) -> Counted:
    """A `system` message's tool addition: the SDK follows "tool", so the tool's own marker is a block marker, and the
    tool's input_schema is free-form."""
    tool, inner = draw(marked({"name": "added", "input_schema": draw(free_form)}))
    return draw(marked({"type": "tool_addition", "tool": tool}, inner))


any_block = text_block() | image_block() | document_block() | tool_use_block() | tool_result_block() | thinking_block()


@st.composite
def message(draw: st.DrawFn, role: str | None = None) -> Counted:
    role = role or draw(st.sampled_from(["user", "user", "assistant", "system"]))
    if role == "system":
        blocks = draw(st.lists(tool_addition_block(), min_size=1, max_size=2))
    elif draw(st.integers(0, 4)) == 0:
        return {"role": role, "content": draw(texts)}, 0
    else:
        blocks = draw(st.lists(any_block, max_size=4))
    return {"role": role, "content": [block for block, _ in blocks]}, sum(n for _, n in blocks)


@st.composite
def messages(draw: st.DrawFn, max_size: int = 3) -> tuple[list[Any], int]:
    drawn = draw(st.lists(message(), max_size=max_size))
    return [m for m, _ in drawn], sum(n for _, n in drawn)


# A reply as a backend returns it: no markers, `type` first or not, free-form tool input with "cache_control" keys.
reply_content = st.lists(
    (text_block() | thinking_block() | tool_use_block()).map(lambda counted: sdk.without_cache_control(counted[0])),
    max_size=4,
)

FIELD_NAMES = (
    "model",
    "max_tokens",
    "thinking",
    "stream",
    "metadata",
    "stop_sequences",
    "tool_choice",
    "cache_control",
    "container",
    "temperature",
    "output_config",
    "x-extra",
)
fields = st.dictionaries(st.sampled_from(FIELD_NAMES), json_values, max_size=5)


@st.composite
def system_value(draw: st.DrawFn) -> Counted:
    if draw(st.booleans()):
        return draw(texts), 0
    blocks = draw(st.lists(text_block(), max_size=3))
    return [b for b, _ in blocks], sum(n for _, n in blocks)


@st.composite
def tools_value(draw: st.DrawFn) -> Counted:
    tools = draw(st.lists(marked({"name": draw(st.text(max_size=5)), "input_schema": draw(free_form)}), max_size=3))
    return [t for t, _ in tools], sum(n for _, n in tools)


ABSENT = object()

# -- the rebuild against the SDK's replay ----------------------------------------------------------------------------


def sdk_stateless_request(
    turn_fields: dict[str, Any], system: Any, tools: Any, earlier: list[Any], new: list[Any]
) -> dict[str, Any]:
    """The full request: this turn's fields, then the fixed fields, then the earlier messages without their block
    markers (the SDK's `without_cache_control`, as its replay sends them), then the new turn with its markers."""
    request = dict(turn_fields)
    if system is not ABSENT:
        request["system"] = system
    if tools is not ABSENT:
        request["tools"] = tools
    request["messages"] = [*cast(list[Any], sdk.without_cache_control(earlier)), *new]
    return request


@THOROUGH
@given(
    turn_fields=fields,
    system=st.just((ABSENT, 0)) | system_value(),
    tools=st.just((ABSENT, 0)) | tools_value(),
    turns=st.lists(st.tuples(messages(), reply_content), max_size=4),
    new=messages(),
)
def test_rebuilt_body_is_the_full_request_with_earlier_markers_dropped(
    turn_fields: dict[str, Any],
    system: Counted,
    tools: Counted,
    turns: list[tuple[tuple[list[Any], int], list[Any]]],
    new: tuple[list[Any], int],
) -> None:
    system_value_, _ = system
    tools_value_, _ = tools
    new_messages, _ = new
    untouched = orjson.dumps([turn_fields, turns, new_messages])

    stored: list[bytes] = []
    earlier: list[Any] = []
    for (sent, _), reply in turns:
        stored += [assembly.stored_message(m) for m in sent]
        stored.append(assembly.stored_reply(reply))
        earlier += [*sent, {"role": "assistant", "content": reply}]
    body = assembly.build_body(
        turn_fields,
        system=None if system_value_ is ABSENT else assembly.encode(system_value_),
        tools=None if tools_value_ is ABSENT else assembly.encode(tools_value_),
        history=assembly.join_history(stored),
        new_messages=[assembly.encode(m) for m in new_messages],
    )

    expected = sdk_stateless_request(turn_fields, system_value_, tools_value_, earlier, new_messages)
    assert orjson.loads(body) == expected
    # Byte for byte: the same layout and key order, compact as orjson writes it.
    assert body == orjson.dumps(expected)
    assert orjson.dumps([turn_fields, turns, new_messages]) == untouched, "the inputs were not modified"


@FAST
@given(message=message())
def test_a_stored_message_is_the_sdk_replay_of_it(message: Counted) -> None:
    value, _ = message
    stored = assembly.stored_message(value)
    assert stored == orjson.dumps(sdk.without_cache_control(value))
    assert assembly.count_cache_markers(orjson.loads(stored)) == 0


@FAST
@given(content=reply_content)
def test_a_stored_reply_keeps_the_content_as_returned(content: list[Any]) -> None:
    stored = assembly.stored_reply(content)
    assert stored == b'{"role":"assistant","content":' + orjson.dumps(content) + b"}"


# -- build_body is valid JSON in every shape -------------------------------------------------------------------------


@FAST
@given(
    turn_fields=fields,
    system=st.none() | json_values,
    with_system=st.booleans(),
    tools=st.none() | json_values,
    with_tools=st.booleans(),
    history=st.lists(json_values, max_size=3),
    new=st.lists(json_values, max_size=3),
)
def test_build_body_is_valid_json_in_every_shape(
    turn_fields: dict[str, Any],
    system: Any,
    with_system: bool,
    tools: Any,
    with_tools: bool,
    history: list[Any],
    new: list[Any],
) -> None:
    body = assembly.build_body(
        turn_fields,
        system=assembly.encode(system) if with_system else None,
        tools=assembly.encode(tools) if with_tools else None,
        history=assembly.join_history([orjson.dumps(item) for item in history]),
        new_messages=[orjson.dumps(item) for item in new],
    )
    parsed = orjson.loads(body)
    expected: dict[str, Any] = {**turn_fields}
    if with_system:
        expected["system"] = system
    if with_tools:
        expected["tools"] = tools
    expected["messages"] = [*history, *new]
    assert parsed == expected
    assert list(parsed) == list(expected), "fields in the client's order, then system, tools, messages"
    assert body == orjson.dumps(expected)


@pytest.mark.parametrize("with_fields", [False, True])
@pytest.mark.parametrize("with_system", [False, True])
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("history", [[], [b'{"role":"user","content":"a"}'], [b"1", b"2"]])
@pytest.mark.parametrize("new", [[], [b'{"role":"user","content":"b"}'], [b"3", b"4"]])
def test_build_body_every_combination(
    with_fields: bool, with_system: bool, with_tools: bool, history: list[bytes], new: list[bytes]
) -> None:
    turn_fields = {"model": "m", "max_tokens": 1} if with_fields else {}
    body = assembly.build_body(
        turn_fields,
        system=b'"s"' if with_system else None,
        tools=b"[]" if with_tools else None,
        history=assembly.join_history(history),
        new_messages=new,
    )
    expected: dict[str, Any] = {**turn_fields}
    if with_system:
        expected["system"] = "s"
    if with_tools:
        expected["tools"] = []
    expected["messages"] = [orjson.loads(m) for m in [*history, *new]]
    assert orjson.loads(body) == expected
    assert body == orjson.dumps(expected)


# -- markers ---------------------------------------------------------------------------------------------------------


@FAST
@given(message=message())
def test_count_cache_markers_counts_the_block_markers_placed(message: Counted) -> None:
    value, placed = message
    assert assembly.count_cache_markers(value) == placed
    assert assembly.count_cache_markers([value, value]) == 2 * placed


@FAST
@given(system=system_value(), tools=tools_value(), new=messages())
def test_markers_of_a_request_add_up(system: Counted, tools: Counted, new: tuple[list[Any], int]) -> None:
    assert assembly.count_cache_markers(system[0]) == system[1]
    assert assembly.count_tool_markers(tools[0]) == tools[1]
    assert assembly.count_cache_markers(new[0]) == new[1]


@FAST
@given(data=free_form)
def test_free_form_data_is_never_counted_nor_stripped(data: dict[str, Any]) -> None:
    block = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": data}
    message = {"role": "assistant", "content": [block]}
    assert assembly.count_cache_markers(message) == 0
    assert orjson.loads(assembly.stored_message(message)) == message
    tool = {"name": "f", "input_schema": data}
    assert assembly.count_tool_markers([tool]) == 0


def test_cache_control_inside_a_tool_input_is_kept() -> None:
    tool_input = {"cache_control": {"type": "ephemeral"}, "content": [{"type": "text", "cache_control": "x"}]}
    message = {
        "role": "assistant",
        "content": [
            {
                "type": "tool_use",
                "id": "toolu_1",
                "name": "f",
                "input": tool_input,
                "cache_control": {"type": "ephemeral"},
            }
        ],
    }
    stored = assembly.stored_message(message)
    assert stored == orjson.dumps(
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": tool_input}]}
    )
    assert assembly.count_cache_markers(message) == 1  # the block's own marker, not the ones in its input


def test_keys_that_hold_blocks_are_the_sdks() -> None:
    assert assembly.KEYS_THAT_HOLD_BLOCKS == sdk.KEYS_THAT_HOLD_BLOCKS


def test_markers_in_nested_tool_results_are_stripped_and_counted() -> None:
    message = {
        "role": "user",
        "content": [
            {
                "type": "tool_result",
                "tool_use_id": "toolu_1",
                "content": [
                    {"type": "text", "text": "r", "cache_control": {"type": "ephemeral"}},
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
                        "cache_control": {"type": "ephemeral", "ttl": "1h"},
                    },
                ],
                "cache_control": {"type": "ephemeral"},
            },
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "plain", "is_error": True},
        ],
    }
    assert assembly.count_cache_markers(message) == 3
    assert assembly.stored_message(message) == (
        b'{"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_1","content":[{"type":"text","text":"r"},'
        b'{"type":"image","source":{"type":"base64","media_type":"image/png","data":"AA=="}}]},'
        b'{"type":"tool_result","tool_use_id":"toolu_2","content":"plain","is_error":true}]}'
    )


def test_null_marker_is_no_marker_but_is_dropped_like_the_sdk() -> None:
    message = {"role": "user", "content": [{"type": "text", "text": "t", "cache_control": None}]}
    assert assembly.count_cache_markers(message) == 0
    assert assembly.stored_message(message) == b'{"role":"user","content":[{"type":"text","text":"t"}]}'


def test_count_tool_markers_of_anything_but_a_list_is_zero() -> None:
    assert assembly.count_tool_markers(None) == 0
    assert assembly.count_tool_markers({"cache_control": {"type": "ephemeral"}}) == 0
    assert assembly.count_tool_markers("tools") == 0
    # The marker on a tool counts; a property named cache_control in its schema does not.
    tool = {
        "name": "search_fares",
        "input_schema": {"type": "object", "properties": {"cache_control": {"type": "object"}}},
        "cache_control": {"type": "ephemeral"},
    }
    assert assembly.count_tool_markers([tool, {"name": "plain", "input_schema": {}}]) == 1


def test_string_content_and_strings_are_kept_as_they_are() -> None:
    message = {"role": "user", "content": 'naïve "quoted" \\ 東京 🚀 \u2028'}
    assert assembly.stored_message(message) == orjson.dumps(message)
    assert "naïve".encode() in assembly.stored_message(message), "UTF-8 as is, not \\u escapes"
    assert assembly.count_cache_markers(message) == 0


def test_empty_rebuild() -> None:
    assert assembly.build_body({}, system=None, tools=None, history=b"", new_messages=[]) == b'{"messages":[]}'
    assert (
        assembly.build_body({"model": "m"}, system=b"[]", tools=None, history=b"", new_messages=[])
        == b'{"model":"m","system":[],"messages":[]}'
    )


def test_a_rebuild_is_the_same_bytes_every_time() -> None:
    message = {"role": "user", "content": [{"type": "text", "text": "t", "cache_control": {"type": "ephemeral"}}]}
    rows = [assembly.stored_message(message), assembly.stored_reply([{"type": "text", "text": "r"}])]
    bodies = {
        assembly.build_body(
            {"model": "m", "max_tokens": 5},
            system=assembly.encode("s"),
            tools=None,
            history=assembly.join_history(list(rows)),
            new_messages=[assembly.encode(message)],
        )
        for _ in range(3)
    }
    assert len(bodies) == 1


# -- fingerprints ----------------------------------------------------------------------------------------------------


def _reorder(value: Any, data: st.DataObject) -> Any:
    """The same JSON value with every object's keys in another order."""
    if isinstance(value, dict):
        keys = data.draw(st.permutations(list(value)))
        return {key: _reorder(value[key], data) for key in keys}
    if isinstance(value, list):
        return [_reorder(item, data) for item in value]
    return value


@FAST
@given(value=json_values, data=st.data())
def test_fingerprint_ignores_key_order(value: Any, data: st.DataObject) -> None:
    reordered = _reorder(value, data)
    assert reordered == value
    if value is None:
        assert assembly.fingerprint(value) is None
        return
    assert assembly.fingerprint(reordered) == assembly.fingerprint(value)
    fp = assembly.fingerprint(value)
    assert fp is not None
    assert len(fp) == 64


def test_fingerprint_examples() -> None:
    assert assembly.fingerprint(None) is None
    assert assembly.fingerprint({"a": 1, "b": {"c": 2, "d": 3}}) == assembly.fingerprint(
        {"b": {"d": 3, "c": 2}, "a": 1}
    )
    assert assembly.fingerprint([1, 2]) != assembly.fingerprint([2, 1]), "list order matters"
    distinct: tuple[Any, ...] = ({}, [], "", 0, False)
    assert len({assembly.fingerprint(value) for value in distinct}) == len(distinct)
