"""SSE framing and reply capture, checked against the official SDK (anthropic 2.14.0) on the same bytes.

The SDK is the reference: its `SSEDecoder` for framing, its `accumulate_event` for the captured reply. Tool input cut
short is parsed by jiter's partial mode, as `accumulate_event` parses it: the capture calls the same library.
"""

from __future__ import annotations

import itertools
import json
import warnings
from typing import Any, cast

import httpx2
import orjson
import pytest
from anthropic._streaming import SSEDecoder
from anthropic.lib.streaming._beta_messages import accumulate_event
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from statestore.upstream.reply_capture import ReplyAccumulator
from statestore.upstream.sse import SSEEvent, SSEParser, is_error_event

MINTED = "msg_statestore_minted_0123456789"
FINE_GRAINED = "fine-grained-tool-streaming-2025-05-14"

# --- helpers ---------------------------------------------------------------------------------------------------------


def sse(payload: dict[str, Any], eol: str = "\n") -> bytes:
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"event: {payload['type']}{eol}data: {data}{eol}{eol}".encode()


def feed_all(chunks: list[bytes]) -> tuple[list[SSEEvent], SSEParser]:
    parser = SSEParser()
    events = [event for chunk in chunks for event in parser.feed(chunk)]
    events.extend(parser.close())
    return events, parser


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *sorted(cuts), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


def same(a: object, b: object) -> bool:
    """Equality that also tells 1 from 1.0 and True from 1, all the way down."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        assert isinstance(b, dict)
        return a.keys() == b.keys() and all(same(a[key], b[key]) for key in a)
    if isinstance(a, list):
        assert isinstance(b, list)
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def sdk_reply(stream: bytes, anthropic_beta: str = "") -> tuple[dict[str, Any] | None, bool]:
    """What a client using the SDK ends up with from `stream`: the message snapshot and whether it saw message_stop.
    Mirrors `Stream.__stream__` (skips ping, unnamed and empty events) and `BetaMessageStream.__stream__`."""
    headers = httpx2.Headers({"anthropic-beta": anthropic_beta} if anthropic_beta else {})
    snapshot: Any = None
    json_bufs: dict[int, bytes] = {}
    stopped = False
    with warnings.catch_warnings():  # pydantic warns about the shapes the SDK builds for unknown blocks; fine
        warnings.simplefilter("ignore")
        for sse_event in SSEDecoder().iter_bytes(iter([stream])):
            if sse_event.event in (None, "ping") or not sse_event.data:
                continue
            assert sse_event.event != "error"
            event = sse_event.json()
            if snapshot is None and event["type"] != "message_start":
                continue
            snapshot = accumulate_event(
                event=cast(Any, event), current_snapshot=snapshot, json_bufs=json_bufs, request_headers=headers
            )
            stopped = stopped or event["type"] == "message_stop"
        return (None if snapshot is None else snapshot.to_dict(mode="json")), stopped


def relay(chunks: list[bytes], accumulator: ReplyAccumulator) -> tuple[bytes, SSEParser]:
    parser = SSEParser()
    out = [accumulator.add(event) for chunk in chunks for event in parser.feed(chunk)]
    out.extend(accumulator.add(event) for event in parser.close())
    return b"".join(out), parser


MESSAGE_START: dict[str, Any] = {
    "type": "message_start",
    "message": {
        "id": "msg_backend_1",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-4-5",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {
            "input_tokens": 12,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": 1,
        },
    },
}


def realistic_stream(eol: str = "\n") -> bytes:
    """Thinking, text with a citation, a tool call with its JSON in pieces, non-ASCII text: what a reply looks like."""
    events: list[dict[str, Any]] = [
        MESSAGE_START,
        {"type": "ping"},
        {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "thinking", "thinking": "", "signature": ""},
        },
        {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "Überlege… 🤔"}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "c2lnbmF0dXJl"}},
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": "", "citations": None}},
        {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Grüße, "}},
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {
                "type": "citations_delta",
                "citation": {
                    "type": "char_location",
                    "cited_text": "日本語",
                    "document_index": 0,
                    "document_title": None,
                    "start_char_index": 0,
                    "end_char_index": 3,
                },
            },
        },
        {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "世界 — done."}},
        {"type": "content_block_stop", "index": 1},
        {
            "type": "content_block_start",
            "index": 2,
            "content_block": {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {}},
        },
        {"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": ""}},
        {
            "type": "content_block_delta",
            "index": 2,
            "delta": {"type": "input_json_delta", "partial_json": '{"city": "Zü'},
        },
        {
            "type": "content_block_delta",
            "index": 2,
            "delta": {"type": "input_json_delta", "partial_json": 'rich", "days": [1, 2'},
        },
        {"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": "]}"}},
        {"type": "content_block_stop", "index": 2},
        {
            "type": "message_delta",
            "delta": {"stop_reason": "tool_use", "stop_sequence": None},
            "usage": {"output_tokens": 87},
        },
        {"type": "message_stop"},
    ]
    return b"".join(sse(event, eol) for event in events)


# --- framing ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("eol", ["\n", "\r\n", "\r"])
def test_every_split_point_gives_the_same_events(eol: str) -> None:
    stream = realistic_stream(eol)
    whole, _ = feed_all([stream])
    assert len(whole) == 19
    assert b"".join(event.raw for event in whole) == stream
    for cut in range(1, len(stream)):
        assert feed_all([stream[:cut], stream[cut:]])[0] == whole, cut
    assert feed_all([bytes([byte]) for byte in stream])[0] == whole


@pytest.mark.parametrize("eol", ["\n", "\r\n", "\r"])
def test_each_event_comes_out_with_its_last_byte(eol: str) -> None:
    stream = realistic_stream(eol)
    events, _ = feed_all([stream])
    ends = list(itertools.accumulate(len(event.raw) for event in events))
    parser = SSEParser()
    released: list[int] = []
    for offset in range(len(stream)):
        released.extend(offset + 1 for _ in parser.feed(stream[offset : offset + 1]))
    released.extend(len(stream) for _ in parser.close())
    # a lone CR ends an event only once the next byte (or the end) shows it is not half of a CRLF
    assert released == [end + 1 if eol == "\r" and end < len(stream) else end for end in ends]


def test_event_fields() -> None:
    events, _ = feed_all([b'event: content_block_delta\ndata: {"a":1}\n\n'])
    assert events == [SSEEvent("content_block_delta", b'{"a":1}', b'event: content_block_delta\ndata: {"a":1}\n\n')]


def test_multi_line_data_is_joined_with_newlines() -> None:
    raw = b'event: x\ndata: {\ndata:  "a": 1\ndata\ndata:}\n\n'
    (event,), _ = feed_all([raw])
    assert event.data == b'{\n "a": 1\n\n}'
    assert event.raw == raw


def test_comments_id_retry_and_unknown_fields_are_ignored_but_kept_in_raw() -> None:
    raw = b": keepalive\nid: 7\nretry: 100\nevent:ping\nfoo: bar\ndata:{}\n\n"
    (event,), _ = feed_all([raw])
    assert event == SSEEvent("ping", b"{}", raw)


def test_comment_only_block_is_an_event_to_forward() -> None:
    events, _ = feed_all([b": ping\n\n", b"event: a\ndata: 1\n\n"])
    assert events == [SSEEvent("", b"", b": ping\n\n"), SSEEvent("a", b"1", b"event: a\ndata: 1\n\n")]


def test_stray_blank_lines_ride_along_with_the_next_event() -> None:
    stream = b"\n\r\nevent: a\ndata: 1\n\n\n\nevent: b\ndata: 2\n\n"
    events, _ = feed_all([stream])
    assert [event.raw for event in events] == [b"\n\r\nevent: a\ndata: 1\n\n", b"\n\nevent: b\ndata: 2\n\n"]


def test_mixed_line_endings() -> None:
    stream = b"event: a\rdata: 1\r\n\nevent: b\r\ndata: 2\n\r\nevent: c\ndata: 3\r\r"
    events, _ = feed_all([stream])
    assert [(event.event, event.data) for event in events] == [("a", b"1"), ("b", b"2"), ("c", b"3")]
    assert b"".join(event.raw for event in events) == stream


def test_a_final_lone_cr_waits_for_the_next_byte_or_the_end() -> None:
    parser = SSEParser()
    assert parser.feed(b"event: a\r\ndata: 1\r\n\r") == []  # the CR may be half of a CRLF
    (event,) = parser.feed(b"\n")
    assert event.raw == b"event: a\r\ndata: 1\r\n\r\n"
    assert parser.feed(b"event: b\rdata: 2\r\r") == []
    (event,) = parser.close()
    assert (event.event, event.data, event.raw) == ("b", b"2", b"event: b\rdata: 2\r\r")
    assert not parser.truncated


def test_an_incomplete_event_at_the_end_is_dropped() -> None:
    parser = SSEParser()
    assert [e.event for e in parser.feed(b"event: a\ndata: 1\n\nevent: message_stop\ndata: {}\n")] == ["a"]
    assert parser.close() == []
    assert parser.truncated


def test_trailing_blank_lines_are_not_a_cut_stream() -> None:
    parser = SSEParser()
    assert len(parser.feed(b"event: a\ndata: 1\n\n\n")) == 1
    assert parser.close() == []
    assert not parser.truncated


def test_a_large_event_in_many_chunks() -> None:
    data = json.dumps({"type": "content_block_start", "x": "é" * 200_000}).encode()
    stream = b"event: content_block_start\ndata: " + data + b"\n\n"
    parser = SSEParser()
    events: list[SSEEvent] = []
    for start in range(0, len(stream), 1000):
        events.extend(parser.feed(stream[start : start + 1000]))
    assert events == [SSEEvent("content_block_start", data, stream)]


_FIELD_VALUE = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\r\n"), max_size=8)
_LINE = st.one_of(
    st.tuples(st.sampled_from(["event", "data", "id", "retry", "foo", ""]), st.sampled_from([":", ": "]), _FIELD_VALUE),
    st.tuples(st.sampled_from(["data", "event"]), st.just(""), st.just("")),
)
_EOL = st.sampled_from(["\n", "\r\n", "\r"])


@settings(max_examples=200, deadline=None)
@given(
    blocks=st.lists(st.tuples(st.lists(st.tuples(_LINE, _EOL), min_size=1, max_size=4), _EOL), max_size=5),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=6),
)
def test_framing_agrees_with_the_sdk_decoder(
    blocks: list[tuple[list[tuple[tuple[str, str, str], str]], str]], cuts: list[int]
) -> None:
    text = "".join(
        "".join(f"{name}{colon}{value}{eol}" for (name, colon, value), eol in lines) + blank for lines, blank in blocks
    )
    stream = text.encode()
    events, parser = feed_all(split_at(stream, [cut for cut in cuts if cut <= len(stream)]))
    assert events == feed_all([stream])[0]
    raw = b"".join(event.raw for event in events)
    assert stream.startswith(raw)
    assert not stream[len(raw) :].strip(b"\r\n") or parser.truncated
    ours = [(event.event, event.data.decode()) for event in events if event.event or event.data]
    sdk = [(e.event or "", e.data) for e in SSEDecoder().iter_bytes(iter([stream])) if e.event or e.data]
    assert ours == sdk


# --- JSON values, for the tool inputs and blocks of the properties below ---------------------------------------------

_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10)
)
JSON_VALUES = st.recursive(
    _SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)
TOOL_INPUTS = st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=5)
JSON_STYLES: st.SearchStrategy[dict[str, Any]] = st.sampled_from(
    [
        {"separators": (",", ":")},
        {"separators": (", ", ": ")},
        {"indent": 1},
        {"ensure_ascii": False, "separators": (", ", ": ")},
    ]
)


def test_long_integers_in_events_stay_exact() -> None:
    number = 2**70 + 1
    block = {"type": "web_search_tool_result", "tool_use_id": "s", "content": {"type": "x", "n": number}}
    events = [
        MESSAGE_START,
        {"type": "content_block_start", "index": 0, "content_block": block},
        {"type": "content_block_stop", "index": 0},
    ]
    reply = ReplyAccumulator(MINTED)
    out, _ = relay([b"".join(sse(event) for event in events)], reply)
    assert reply.message["content"][0]["content"]["n"] == number
    assert same(reply.message, sdk_reply(out)[0])


def test_long_integers_in_tool_input_stay_exact() -> None:
    number = 123456789012345678901234567890
    events = [
        MESSAGE_START,
        {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "tool_use", "id": "t", "name": "f", "input": {}},
        },
        {"type": "content_block_delta", "index": 0, "delta": {"type": "input_json_delta", "partial_json": '{"n": '}},
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "input_json_delta", "partial_json": f"{number}}}"},
        },
        {"type": "content_block_stop", "index": 0},
        {"type": "message_stop"},
    ]
    reply = ReplyAccumulator(MINTED)
    out, _ = relay([b"".join(sse(event) for event in events)], reply)
    assert reply.complete
    assert reply.message["content"][0]["input"] == {"n": number}
    assert same(reply.message, sdk_reply(out)[0])


# --- capture ---------------------------------------------------------------------------------------------------------


def test_realistic_stream_is_captured_like_the_sdk_does() -> None:
    stream = realistic_stream()
    reply = ReplyAccumulator(MINTED)
    out, _ = relay([stream], reply)
    assert reply.message_started and reply.stopped and reply.complete
    snapshot, stopped = sdk_reply(out)
    assert stopped
    assert snapshot is not None and snapshot["id"] == MINTED
    assert same(reply.message, snapshot)
    assert reply.stop_reason == "tool_use"
    assert reply.usage["output_tokens"] == 87
    assert reply.message["content"][2]["input"] == {"city": "Zürich", "days": [1, 2]}
    assert reply.reply_param() == {"role": "assistant", "content": reply.message["content"]}
    assert not reply.served_by_fallback


def test_message_start_keeps_key_order_and_other_events_their_bytes() -> None:
    stream = realistic_stream()
    events, _ = feed_all([stream])
    reply = ReplyAccumulator(MINTED)
    forwarded = [reply.add(event) for event in events]
    start = forwarded[0]
    assert start.startswith(b"event: message_start\ndata: ") and start.endswith(b"\n\n")
    rewritten = orjson.loads(start.split(b"data: ", 1)[1])
    expected = json.loads(events[0].data)
    expected["message"]["id"] = MINTED
    assert list(rewritten) == list(expected) and list(rewritten["message"]) == list(expected["message"])
    assert rewritten == expected
    assert forwarded[1:] == [event.raw for event in events[1:]]


def test_message_stop_is_visible_before_its_bytes_leave() -> None:
    reply = ReplyAccumulator(MINTED)
    seen: list[tuple[bool, bytes]] = []
    for event in feed_all([realistic_stream()])[0]:
        out = reply.add(event)
        seen.append((reply.stopped, out))
    assert [stopped for stopped, _ in seen].index(True) == len(seen) - 1
    assert seen[-1][1] == sse({"type": "message_stop"})


def test_error_event_is_passed_through_and_spoils_the_turn() -> None:
    error = sse({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})
    stream = realistic_stream().replace(sse({"type": "message_stop"}), error + sse({"type": "message_stop"}))
    events, _ = feed_all([stream])
    reply = ReplyAccumulator(MINTED)
    forwarded = [reply.add(event) for event in events]
    assert [is_error_event(event) for event in events].count(True) == 1
    assert error in forwarded
    assert reply.error_seen and reply.stopped and not reply.complete


def test_cut_stream_is_not_complete() -> None:
    stream = realistic_stream()
    reply = ReplyAccumulator(MINTED)
    _, parser = relay([stream[:-3]], reply)
    assert parser.truncated
    assert reply.message_started and not reply.stopped and not reply.complete


def test_nothing_before_message_start_is_captured() -> None:
    reply = ReplyAccumulator(MINTED)
    early = sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": "x"}})
    assert reply.add(feed_all([early])[0][0]) == early
    assert not reply.message_started
    assert reply.stop_reason is None and reply.usage == {} and not reply.served_by_fallback
    with pytest.raises(RuntimeError):
        _ = reply.message
    relay([realistic_stream()], reply)
    assert [block["type"] for block in reply.message["content"]] == ["thinking", "text", "tool_use"]


def test_malformed_events_set_failure_and_are_forwarded() -> None:
    bad = b"event: content_block_delta\ndata: {not json\n\n"
    stream = realistic_stream().replace(sse({"type": "content_block_stop", "index": 1}), bad)
    reply = ReplyAccumulator(MINTED)
    out, _ = relay([stream], reply)
    assert bad in out
    assert reply.stopped and not reply.complete
    assert reply.failure == "malformed content_block_delta event (JSONDecodeError)"


def test_delta_for_a_missing_block_is_a_failure() -> None:
    reply = ReplyAccumulator(MINTED)
    stray = sse({"type": "content_block_delta", "index": 5, "delta": {"type": "text_delta", "text": "x"}})
    relay([sse(MESSAGE_START), stray], reply)
    assert reply.failure is not None and "IndexError" in reply.failure


def test_unparseable_tool_input_is_a_failure() -> None:
    events = [
        MESSAGE_START,
        {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "tool_use", "id": "t", "name": "f", "input": {}},
        },
        {"type": "content_block_delta", "index": 0, "delta": {"type": "input_json_delta", "partial_json": '{"a": 1,}'}},
        {"type": "message_stop"},
    ]
    reply = ReplyAccumulator(MINTED)
    relay([b"".join(sse(event) for event in events)], reply)
    assert not reply.complete
    assert reply.failure == "unparseable tool input"


def test_empty_tool_input_keeps_the_input_of_content_block_start() -> None:
    start = {"type": "tool_use", "id": "t", "name": "f", "input": {"given": True}}
    events = [
        MESSAGE_START,
        {"type": "content_block_start", "index": 0, "content_block": start},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "input_json_delta", "partial_json": ""}},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_stop"},
    ]
    reply = ReplyAccumulator(MINTED)
    out, _ = relay([b"".join(sse(event) for event in events)], reply)
    assert reply.complete
    assert reply.message["content"][0]["input"] == {"given": True}
    assert same(reply.message, sdk_reply(out)[0])


def test_tool_input_cut_by_max_tokens_follows_the_fine_grained_beta() -> None:
    events = [
        MESSAGE_START,
        {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "tool_use", "id": "t", "name": "f", "input": {}},
        },
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "input_json_delta", "partial_json": '{"a": 1, "b": "hal'},
        },
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 5}},
        {"type": "message_stop"},
    ]
    stream = b"".join(sse(event) for event in events)
    for beta, expected in [("", {"a": 1}), (f"other-beta,{FINE_GRAINED}", {"a": 1, "b": "hal"})]:
        reply = ReplyAccumulator(MINTED, anthropic_beta=beta)
        out, _ = relay([stream], reply)
        assert reply.complete
        assert reply.message["content"][0]["input"] == expected
        assert same(reply.message, sdk_reply(out, beta)[0])


def test_reading_the_message_mid_stream_does_not_disturb_the_capture() -> None:
    stream = realistic_stream()
    events, _ = feed_all([stream])
    reply = ReplyAccumulator(MINTED)
    for event in events:
        reply.add(event)
        if reply.message_started:
            _ = reply.message
    snapshot, _ = sdk_reply(stream)
    assert snapshot is not None
    assert same(reply.message, snapshot | {"id": MINTED})


def test_fallback_block_and_iterations() -> None:
    events = [
        MESSAGE_START,
        {
            "type": "content_block_start",
            "index": 0,
            "content_block": {
                "type": "fallback",
                "from": {"model": "claude-opus-4-1"},
                "to": {"model": "claude-haiku-4-5"},
                "trigger": {"type": "refusal", "category": "cyber"},
            },
        },
        {"type": "content_block_stop", "index": 0},
        {
            "type": "message_delta",
            "delta": {"stop_reason": "end_turn", "stop_sequence": None},
            "usage": {
                "output_tokens": 3,
                "iterations": [
                    {
                        "type": "fallback_message",
                        "model": "claude-haiku-4-5",
                        "input_tokens": 1,
                        "output_tokens": 3,
                        "cache_creation_input_tokens": 0,
                        "cache_read_input_tokens": 0,
                    }
                ],
            },
        },
        {"type": "message_stop"},
    ]
    reply = ReplyAccumulator(MINTED)
    out, _ = relay([b"".join(sse(event) for event in events)], reply)
    assert reply.message["model"] == "claude-haiku-4-5"
    assert reply.served_by_fallback
    assert same(reply.message, sdk_reply(out)[0])


def test_a_second_message_start_gets_the_same_id_and_is_not_captured() -> None:
    second = dict(MESSAGE_START, message=dict(MESSAGE_START["message"], model="other", id="msg_backend_2"))
    stream = realistic_stream().replace(sse({"type": "ping"}), sse(second))
    reply = ReplyAccumulator(MINTED)
    out, _ = relay([stream], reply)
    assert b"msg_backend" not in out
    assert reply.message["model"] == "claude-sonnet-4-5"
    assert same(reply.message, sdk_reply(out)[0])


# --- capture, property: any valid stream, cut anywhere, against the SDK ---------------------------------------------

_TEXT = st.text(max_size=12)
_TOKENS = st.integers(min_value=0, max_value=10**6)
_CITATIONS = st.one_of(
    st.fixed_dictionaries(
        {
            "type": st.just("char_location"),
            "cited_text": _TEXT,
            "document_index": st.integers(0, 3),
            "document_title": st.none() | _TEXT,
            "start_char_index": _TOKENS,
            "end_char_index": _TOKENS,
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("web_search_result_location"),
            "cited_text": _TEXT,
            "encrypted_index": _TEXT,
            "title": st.none() | _TEXT,
            "url": st.just("https://example.com/a"),
        }
    ),
)
_ITERATION = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["message", "fallback_message"]),
        "model": st.just("claude-sonnet-4-5"),
        "input_tokens": _TOKENS,
        "output_tokens": _TOKENS,
        "cache_creation_input_tokens": _TOKENS,
        "cache_read_input_tokens": _TOKENS,
    }
)
_USAGE_DELTA = st.fixed_dictionaries(
    {"output_tokens": _TOKENS},
    optional={
        "input_tokens": st.none() | _TOKENS,
        "cache_creation_input_tokens": st.none() | _TOKENS,
        "cache_read_input_tokens": st.none() | _TOKENS,
        "server_tool_use": st.none()
        | st.fixed_dictionaries({"web_search_requests": _TOKENS, "web_fetch_requests": _TOKENS}),
        "output_tokens_details": st.none() | st.fixed_dictionaries({"thinking_tokens": _TOKENS}),
        "iterations": st.none() | st.lists(_ITERATION, max_size=3),
    },
)
_CONTAINER = st.fixed_dictionaries({"id": st.just("container_1"), "expires_at": st.just("2026-11-29T12:05:00Z")})
_MESSAGE_DELTA: st.SearchStrategy[dict[str, Any]] = st.fixed_dictionaries(
    {
        "type": st.just("message_delta"),
        "delta": st.fixed_dictionaries(
            {
                "stop_reason": st.sampled_from(["end_turn", "tool_use", "max_tokens", "pause_turn", "refusal"]),
                "stop_sequence": st.none() | _TEXT,
            },
            optional={
                "stop_details": st.none()
                | st.fixed_dictionaries({"type": st.just("refusal"), "category": st.just("cyber")}),
                "container": st.none() | _CONTAINER,
            },
        ),
        "usage": _USAGE_DELTA,
    },
    optional={
        "context_management": st.none()
        | st.fixed_dictionaries(
            {
                "applied_edits": st.lists(
                    st.fixed_dictionaries(
                        {
                            "type": st.just("clear_tool_uses_20250919"),
                            "cleared_input_tokens": _TOKENS,
                            "cleared_tool_uses": _TOKENS,
                        }
                    ),
                    max_size=2,
                )
            }
        ),
        "input_transformations": st.none() | st.just([]),
    },
)


def _pieces(draw: st.DrawFn, text: str) -> list[str]:
    """`text` in arbitrary pieces, some of them empty."""
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=6)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@st.composite
def content_blocks(draw: st.DrawFn) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A content block as content_block_start gives it, and the deltas that follow."""
    kind = draw(
        st.sampled_from(
            [
                "text",
                "thinking",
                "redacted",
                "tool_use",
                "server_tool_use",
                "mcp_tool_use",
                "search_result",
                "compaction",
                "fallback",
                "future",
            ]
        )
    )
    if kind == "text":
        start: dict[str, Any] = {"type": "text", "text": draw(st.sampled_from(["", "Pre"]))}
        if draw(st.booleans()):
            start["citations"] = draw(st.none() | st.just([]))
        deltas: list[dict[str, Any]] = []
        for piece in _pieces(draw, draw(st.text(max_size=40))):
            deltas.append({"type": "text_delta", "text": piece})
            if draw(st.integers(0, 2)) == 0:
                deltas.append({"type": "citations_delta", "citation": draw(_CITATIONS)})
        return start, deltas
    if kind == "thinking":
        deltas = [{"type": "thinking_delta", "thinking": piece} for piece in _pieces(draw, draw(st.text(max_size=40)))]
        deltas += [{"type": "signature_delta", "signature": draw(_TEXT)} for _ in range(draw(st.integers(0, 2)))]
        return {"type": "thinking", "thinking": "", "signature": ""}, deltas
    if kind == "redacted":
        return {"type": "redacted_thinking", "data": draw(_TEXT)}, []
    if kind in ("tool_use", "server_tool_use", "mcp_tool_use"):
        start = {"type": kind, "id": "toolu_1", "name": "web_search" if kind == "server_tool_use" else "f", "input": {}}
        if kind == "mcp_tool_use":
            start["server_name"] = "srv"
        text = json.dumps(draw(TOOL_INPUTS), **draw(JSON_STYLES))
        if draw(st.integers(0, 4)) == 0:  # cut short, as max_tokens does
            text = text[: draw(st.integers(0, len(text)))]
        return start, [{"type": "input_json_delta", "partial_json": piece} for piece in _pieces(draw, text)]
    if kind == "search_result":
        result = {"type": "web_search_result", "url": "https://e.com", "title": draw(_TEXT), "encrypted_content": "x"}
        return {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": [result]}, []
    if kind == "compaction":
        deltas = [
            draw(
                st.fixed_dictionaries(
                    {"type": st.just("compaction_delta")}, optional={"content": _TEXT, "encrypted_content": _TEXT}
                )
            )
            for _ in range(draw(st.integers(0, 3)))
        ]
        return {"type": "compaction", "content": None}, deltas
    if kind == "fallback":
        to_model = draw(st.sampled_from(["claude-sonnet-4-5", "claude-haiku-4-5"]))
        block = {
            "type": "fallback",
            "from": {"model": "claude-opus-4-1"},
            "to": {"model": to_model},
            "trigger": {"type": "refusal"},
        }
        return block, []
    return {"type": "future_block", "payload": draw(JSON_VALUES)}, [{"type": "future_delta", "x": 1}]


@st.composite
def reply_streams(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Stream events of one reply, in order, with pings and unknown events sprinkled in."""
    message = dict(MESSAGE_START["message"], model="claude-opus-4-1")  # what a fallback block relabels
    message["usage"] = draw(
        st.fixed_dictionaries(
            {"input_tokens": _TOKENS, "output_tokens": _TOKENS},
            optional={"cache_read_input_tokens": _TOKENS, "service_tier": st.just("standard"), "iterations": st.none()},
        )
    )
    if draw(st.booleans()):
        message["container"] = draw(_CONTAINER)
    events: list[dict[str, Any]] = [{"type": "message_start", "message": message}]
    for index, (start, deltas) in enumerate(draw(st.lists(content_blocks(), min_size=1, max_size=6))):
        events.append({"type": "content_block_start", "index": index, "content_block": start})
        events.extend({"type": "content_block_delta", "index": index, "delta": delta} for delta in deltas)
        events.append({"type": "content_block_stop", "index": index})
    events.extend(draw(st.lists(_MESSAGE_DELTA, min_size=1, max_size=2)))
    events.append({"type": "message_stop"})
    for _ in range(draw(st.integers(0, 3))):
        position = draw(st.integers(0, len(events)))
        events.insert(position, draw(st.sampled_from([{"type": "ping"}, {"type": "future_event", "n": 1}])))
    return events


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    events=reply_streams(),
    eol=st.sampled_from(["\n", "\n", "\r\n"]),
    fine_grained=st.booleans(),
    data=st.data(),
)
def test_capture_matches_the_sdk(
    events: list[dict[str, Any]], eol: str, fine_grained: bool, data: st.DataObject
) -> None:
    segments = [sse(event, eol) for event in events]
    whole = b"".join(segments)
    # the stream may be cut anywhere (a backend that dies mid-reply)
    cut = data.draw(st.none() | st.integers(0, len(whole)), label="cut")
    received = whole if cut is None else whole[:cut]
    chunks = split_at(received, data.draw(st.lists(st.integers(0, len(received)), max_size=8), label="chunks"))
    beta = FINE_GRAINED if fine_grained else ""

    reply = ReplyAccumulator(MINTED, anthropic_beta=beta)
    out, parser = relay(chunks, reply)

    # forwarded bytes: every whole event as received, message_start re-encoded with the minted id
    expected = b""
    consumed = 0
    cut_inside_an_event = False
    for event, segment in zip(events, segments, strict=True):
        got = received[consumed : consumed + len(segment)]
        consumed += len(segment)
        # at the end of the stream a CR is a whole line terminator, so a CRLF event missing its last LF is whole
        if got != segment and not (eol == "\r\n" and got == segment[:-1]):
            cut_inside_an_event = got != b""
            break
        if event["type"] == "message_start":
            payload = {"type": "message_start", "message": dict(event["message"], id=MINTED)}
            got = b"event: message_start\ndata: " + orjson.dumps(payload) + b"\n\n"
        expected += got
    assert out == expected
    assert parser.truncated == cut_inside_an_event

    snapshot, sdk_stopped = sdk_reply(out, beta)
    assert reply.stopped == sdk_stopped
    assert reply.failure is None
    if snapshot is None:
        assert not reply.message_started
        return
    assert snapshot["id"] == MINTED
    assert same(reply.message, snapshot)
    assert reply.complete == sdk_stopped
    assert reply.stop_reason == snapshot.get("stop_reason")
    iterations = snapshot["usage"].get("iterations") or []
    assert reply.served_by_fallback == any(item["type"] == "fallback_message" for item in iterations)


def test_a_stream_without_message_start_gets_one_for_the_turns_model() -> None:
    """llama.cpp's server leaves message_start out when its first token is part of a UTF-8 character: the capture
    opens the message itself (minted id, the turn's model), so the SDK can read the stream and the reply is stored."""
    text_block = {"type": "text", "text": ""}
    events = [
        ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": text_block}),
        (
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "é"}},
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "message_delta",
            {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 3}},
        ),
        ("message_stop", {"type": "message_stop"}),
    ]
    stream = b"".join(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode() for name, data in events)
    capture = ReplyAccumulator("msg_minted", model="tiny")
    forwarded = b"".join(capture.add(event) for event in SSEParser().feed(stream))
    assert capture.complete and capture.backend_id is None
    assert capture.message["id"] == "msg_minted" and capture.message["model"] == "tiny"
    assert capture.message["content"] == [{"type": "text", "text": "é"}]
    assert capture.usage == {"output_tokens": 3}
    assert forwarded.startswith(b"event: message_start\n") and forwarded.endswith(stream)
    # Without a model (the default), such a stream is forwarded as it came and nothing is captured.
    plain = ReplyAccumulator("msg_minted")
    assert b"".join(plain.add(event) for event in SSEParser().feed(stream)) == stream
    assert not plain.message_started
