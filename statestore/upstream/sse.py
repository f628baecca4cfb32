"""Incremental SSE framing and capture of a streamed Messages reply, on the hot path of every streamed turn.

`SSEParser` cuts the backend's bytes into events as they arrive, keeping each event's exact bytes so the relay can
forward them unchanged. `ReplyAccumulator` rebuilds the final Message from those events the way the official SDK's
`accumulate_event` (anthropic 2.14.0, `lib/streaming/_beta_messages.py`) does, but on plain JSON dicts, and
re-encodes `message_start` with the id statestore minted. Typical use by the relay:

    parser, reply = SSEParser(), ReplyAccumulator(minted_id, anthropic_beta=request_beta_header)
    async for chunk in backend_stream:
        for event in parser.feed(chunk):
            out = reply.add(event)
            if reply.stopped and not committed:   # `out` is message_stop: commit before the client sees it
                ...commit reply.reply_param() if reply.complete (and policy allows)...
            await send(out)
    parser.close()  # a cut stream leaves an incomplete event behind: it is dropped, never forwarded

(`event.event == "message_stop"` tells the same before `add()`; everything before it has been captured by then.)
The captured message may hold integers beyond 64 bits, as the SDK's would: `orjson.dumps` refuses those.
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

import orjson

__all__ = ["ReplyAccumulator", "SSEEvent", "SSEParser", "is_error_event"]


class SSEEvent(NamedTuple):
    """One complete SSE event.

    `event` is the `event:` field ("" when absent), `data` the `data:` lines joined by `\\n`, `raw` the exact bytes
    the event arrived as, through its terminating blank line (plus any stray blank lines before it), so that the
    concatenation of all `raw`s is the stream itself.
    """

    event: str
    data: bytes
    raw: bytes


# Two line terminators in a row end an event. A lone CR counts as a terminator only when no LF follows it, so that a
# CRLF is never read as two; the second terminator may be a lone CR, which is ambiguous at the end of the buffer.
_EVENT_END = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r|\n)")
_NOT_EOL = re.compile(rb"[^\r\n]")
_CR = 13
_EOL_BYTES = (10, _CR)


class SSEParser:
    """Splits a byte stream into `SSEEvent`s; chunks may be cut anywhere (mid-line, mid-CRLF, mid-UTF-8)."""

    __slots__ = ("_body", "_crs", "_parts", "_size", "_tail", "_truncated")

    def __init__(self) -> None:
        self._parts: list[bytes] = []  # unconsumed input, kept as chunks so a huge event costs one join, not many
        self._size = 0
        self._body = -1  # offset in the unconsumed input of the pending event's first non-blank byte; -1: none yet
        self._tail = b""  # last bytes of the pending body in which an event end could straddle the next chunk
        # Anthropic streams use LF only; `bytes.find` serves those, the regex only streams that ever sent a CR.
        self._crs = False
        self._truncated = False

    @property
    def truncated(self) -> bool:
        """After `close()`: whether the stream ended inside an event (a cut stream)."""
        return self._truncated

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """The events completed by `chunk`, in order; the rest stays buffered."""
        if not chunk:
            return []
        if not self._crs and b"\r" in chunk:
            self._crs = True
        if not self._parts:
            return self._cut(chunk, 0, at_eof=False)
        if self._body >= 0 and not self._may_end(self._tail + chunk):
            self._parts.append(chunk)
            self._size += len(chunk)
            self._tail = (self._tail + chunk)[-3:]
            return []
        scan = max(self._body, self._size - 3)  # the old bytes were searched already
        self._parts.append(chunk)
        return self._cut(b"".join(self._parts), scan, at_eof=False)

    def close(self) -> list[SSEEvent]:
        """End of stream: returns an event that only lacked certainty about its last CR; drops an incomplete one."""
        events: list[SSEEvent] = []
        if self._parts:
            events = self._cut(b"".join(self._parts), max(self._body, 0), at_eof=True)
        self._truncated = self._body >= 0
        self._parts, self._size, self._body, self._tail = [], 0, -1, b""
        return events

    def _may_end(self, window: bytes) -> bool:
        if not self._crs:
            return b"\n\n" in window
        match = _EVENT_END.search(window)
        return match is not None and not (match.end() == len(window) and window[-1] == _CR)

    def _cut(self, data: bytes, scan: int, *, at_eof: bool) -> list[SSEEvent]:
        events: list[SSEEvent] = []
        size = len(data)
        pos = 0
        body = -1
        while pos < size:
            body = pos
            if data[pos] in _EOL_BYTES:  # stray blank lines ride along in the next event's raw
                first = _NOT_EOL.search(data, pos)
                if first is None:
                    body = -1
                    break
                body = first.start()
            start = body if body > scan else scan
            if self._crs:
                match = _EVENT_END.search(data, start)
                if match is None:
                    break
                end = match.end()
                if end == size and data[end - 1] == _CR and not at_eof:
                    break  # that CR may be the first half of a CRLF that belongs to this event
                event = _event(data[body : match.start()].splitlines(), data[pos:end])
            else:
                found = data.find(b"\n\n", start)
                if found < 0:
                    break
                end = found + 2
                event = _lf_event(data[body:found], data[pos:end])
            events.append(event)
            pos = end
            body = -1
        if pos == size:  # the usual case: the chunk ended with an event
            if self._size:
                self._parts, self._size, self._body, self._tail = [], 0, -1, b""
            return events
        rest = data[pos:] if pos else data
        self._parts = [rest]
        self._size = len(rest)
        self._body = body - pos if body >= 0 else -1
        self._tail = rest[max(self._body, self._size - 3) :] if body >= 0 else b""
        return events


def _lf_event(block: bytes, raw: bytes) -> SSEEvent:
    # Every event of the Messages API is `event: <name>\ndata: <json>`: take that shape without splitting lines.
    if block.startswith(b"event: "):
        newline = block.find(b"\n")
        if block.startswith(b"data: ", newline + 1) and block.find(b"\n", newline + 1) < 0:
            return SSEEvent(block[7:newline].decode("utf-8", "replace"), block[newline + 7 :], raw)
    return _event(block.split(b"\n"), raw)


def _event(lines: list[bytes], raw: bytes) -> SSEEvent:
    name = ""
    data: list[bytes] = []
    for line in lines:
        # Field parsing per the SSE spec: one optional space after the colon; comments (":..."), `id`, `retry` and
        # unknown fields carry nothing the relay or the capture needs.
        if line.startswith(b"data:"):
            data.append(line[6:] if line[5:6] == b" " else line[5:])
        elif line.startswith(b"event:"):
            name = (line[7:] if line[6:7] == b" " else line[6:]).decode("utf-8", "replace")
        elif line == b"data":
            data.append(b"")
        elif line == b"event":
            name = ""
    return SSEEvent(name, b"\n".join(data), raw)


def is_error_event(event: SSEEvent) -> bool:
    """An `error` event (e.g. overloaded mid-stream): forwarded to the client, and the turn is then not stored."""
    return event.event == "error"


_TOOL_INPUT_BLOCKS = frozenset(("tool_use", "server_tool_use", "mcp_tool_use"))  # the SDK's TRACKS_TOOL_INPUT
_FINE_GRAINED_TOOL_STREAMING = "fine-grained-tool-streaming-2025-05-14"
# message_delta usage fields the SDK copies only when present and not null (they are cumulative totals)
_OPTIONAL_USAGE = (
    "input_tokens",
    "cache_creation_input_tokens",
    "cache_read_input_tokens",
    "server_tool_use",
    "output_tokens_details",
    "iterations",
    "fallback_credit",
)
# orjson turns integers beyond 64 bits into floats without a word; the SDK's parsers keep them exact.
_LONG_DIGITS = re.compile(rb"[0-9]{19}")
_LONG_DIGITS_STR = re.compile(r"[0-9]{19}")


class ReplyAccumulator:
    """Captures the reply of one streamed turn and rewrites its `message_start` id.

    Feed it every event in order with `add()`, which returns the bytes to forward. The captured message follows the
    SDK's accumulator: events before `message_start` and unknown event, block and delta types are ignored; `ping`,
    `error`, events without a name and events without data are not parsed. A malformed event does not raise: it sets
    `failure` (a fixed reason, never content) and the reply is not `complete`.
    """

    __slots__ = (
        "_content",
        "_dirty_json",
        "_failure",
        "_message",
        "_message_id",
        "_parts",
        "_stopped",
        "_tool_json",
        "_trailing_strings",
        "backend_id",
        "error_seen",
    )

    def __init__(self, message_id: str, *, anthropic_beta: str = "") -> None:
        """`message_id`: the id statestore minted. `anthropic_beta`: the request's `anthropic-beta` header, which
        decides, as in the SDK, how a tool input cut short (max_tokens) is parsed."""
        self._message_id = message_id
        self._trailing_strings = _FINE_GRAINED_TOOL_STREAMING in anthropic_beta
        self._message: dict[str, Any] | None = None
        self._content: list[Any] = []
        # Deltas are collected and joined once when the message is read: `text += delta` on a dict value copies the
        # whole text on every token, and the SDK's re-parse of the tool JSON on every delta is quadratic too.
        self._parts: dict[int, list[str]] = {}  # text / thinking fragments by block position
        self._tool_json: dict[int, list[str]] = {}  # the SDK's json_bufs
        self._dirty_json: set[int] = set()
        self._stopped = False
        # The id the backend gave the reply, before it is replaced by the minted one.
        self.backend_id: str | None = None
        self.error_seen = False
        self._failure: str | None = None

    @property
    def message_started(self) -> bool:
        return self._message is not None

    @property
    def stopped(self) -> bool:
        """`message_stop` was seen (after `message_start`). It turns true in the `add()` of that event."""
        return self._stopped

    @property
    def failure(self) -> str | None:
        """Why the reply could not be captured (a fixed phrase, never content), or None."""
        if self._message is not None:
            self._flush()  # the tool input JSON is only parsed now
        return self._failure

    @property
    def complete(self) -> bool:
        """The whole reply arrived and was captured: started, stopped, no `error` event, nothing malformed."""
        return self._message is not None and self._stopped and not self.error_seen and self.failure is None

    @property
    def message(self) -> dict[str, Any]:
        """The reply as the non-streaming API returns it, with the minted id. Raises before `message_start`."""
        if self._message is None:
            raise RuntimeError("no message_start seen")
        self._flush()
        return self._message

    @property
    def stop_reason(self) -> str | None:
        reason = self._message.get("stop_reason") if self._message is not None else None
        return reason if isinstance(reason, str) else None

    @property
    def usage(self) -> dict[str, Any]:
        """The reply's usage so far ({} before `message_start`)."""
        usage = self._message.get("usage") if self._message is not None else None
        return usage if isinstance(usage, dict) else {}

    @property
    def served_by_fallback(self) -> bool:
        """A fallback model wrote (part of) the reply: such a turn is not stored."""
        iterations = self.usage.get("iterations")
        return isinstance(iterations, list) and any(
            isinstance(item, dict) and item.get("type") == "fallback_message" for item in iterations
        )

    def reply_param(self) -> dict[str, Any]:
        """The reply as the assistant message of the thread."""
        return {"role": "assistant", "content": self.message["content"]}

    def add(self, event: SSEEvent) -> bytes:
        """Capture `event`; return the bytes to forward: `event.raw`, or for `message_start` the event re-encoded."""
        name = event.event
        if not name or name == "ping":
            return event.raw
        if name == "error":
            self.error_seen = True
            return event.raw
        if not event.data:
            return event.raw
        try:
            # Deltas carry no long numbers (their payload is strings); other events might, rarely enough to check.
            payload = orjson.loads(event.data) if name == "content_block_delta" else _loads(event.data)
            kind = payload["type"]
            if kind == "content_block_delta":  # nearly every event
                if self._message is not None:
                    self._delta(payload)
            elif kind == "message_start":
                return self._start(name, payload)
            elif self._message is not None:
                self._apply(kind, payload)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError, RecursionError) as exc:
            self._fail(f"malformed {name} event ({type(exc).__name__})")
        return event.raw

    def _start(self, name: str, payload: dict[str, Any]) -> bytes:
        message = payload["message"]
        if self._message is None and isinstance(message.get("id"), str):
            self.backend_id = message["id"]
        message["id"] = self._message_id
        # Only the event and data lines: a comment or stray blank line of the original event is not worth keeping.
        out = b"event: " + name.encode() + b"\ndata: " + _dumps(payload) + b"\n\n"
        # The SDK keeps the first message_start; a later one is forwarded (with the same id) and otherwise ignored.
        if self._message is None:
            content = message.get("content")
            if isinstance(content, list):
                self._message, self._content = message, content
            else:
                self._fail("malformed message_start event")
        return out

    def _apply(self, kind: str, payload: dict[str, Any]) -> None:
        if kind == "content_block_start":
            block = payload["content_block"]
            self._content.append(block)
            if block.get("type") == "fallback":
                # the final hop's fallback block names the model that served the reply, as in a non-streamed one
                self._message_dict()["model"] = block["to"]["model"]
        elif kind == "content_block_stop":
            self._position(payload["index"])  # the SDK fails on a stop for no block
        elif kind == "message_delta":
            self._message_delta(payload)
        elif kind == "message_stop":
            self._stopped = True

    def _position(self, index: Any) -> int:
        # range() normalises a negative index as the SDK's list indexing does, and raises where it would
        position: int = range(len(self._content))[index]
        return position

    def _delta(self, payload: dict[str, Any]) -> None:
        content = self._content
        index: int = range(len(content))[payload["index"]]  # as in _position
        block = content[index]
        delta = payload["delta"]
        kind = delta.get("type")
        block_type = block.get("type")
        if kind == "text_delta":
            if block_type == "text":
                self._append(block, index, "text", delta["text"])
        elif kind == "input_json_delta":
            if block_type in _TOOL_INPUT_BLOCKS:
                fragment = delta["partial_json"]
                if not isinstance(fragment, str):
                    raise TypeError("partial_json is not a string")
                self._tool_json.setdefault(index, []).append(fragment)
                self._dirty_json.add(index)
        elif kind == "thinking_delta":
            if block_type == "thinking":
                self._append(block, index, "thinking", delta["thinking"])
        elif kind == "citations_delta":
            if block_type == "text":
                citations = block.get("citations")
                if citations:
                    citations.append(delta["citation"])
                else:
                    block["citations"] = [delta["citation"]]
        elif kind == "signature_delta":
            if block_type == "thinking":
                block["signature"] = delta["signature"]  # replaces, as in the SDK
        elif kind == "compaction_delta" and block_type == "compaction":
            # replaces both fields, even with null when the delta leaves one out, as in the SDK
            block["content"] = delta.get("content")
            block["encrypted_content"] = delta.get("encrypted_content")

    def _append(self, block: dict[str, Any], index: int, field: str, fragment: str) -> None:
        if not isinstance(fragment, str):
            raise TypeError(f"{field} delta is not a string")
        parts = self._parts.get(index)
        if parts is None:
            initial = block[field]
            if not isinstance(initial, str):
                raise TypeError(f"{field} of the block is not a string")
            parts = self._parts[index] = [initial]
        parts.append(fragment)

    def _message_delta(self, payload: dict[str, Any]) -> None:
        message = self._message_dict()
        delta = payload["delta"]
        usage_delta = payload["usage"]
        message["stop_reason"] = delta.get("stop_reason")
        message["stop_sequence"] = delta.get("stop_sequence")
        message["stop_details"] = delta.get("stop_details")
        if delta.get("container") is not None:
            message["container"] = delta["container"]
        usage = message["usage"]
        usage["output_tokens"] = usage_delta.get("output_tokens")
        if payload.get("context_management") is not None:
            message["context_management"] = payload["context_management"]
        # only sent after a mid-stream fallback, replacing the message_start value
        if payload.get("input_transformations") is not None:
            message["input_transformations"] = payload["input_transformations"]
        for key in _OPTIONAL_USAGE:
            value = usage_delta.get(key)
            if value is not None:
                usage[key] = value

    def _message_dict(self) -> dict[str, Any]:
        assert self._message is not None
        return self._message

    def _flush(self) -> None:
        content = self._content
        for index, parts in self._parts.items():
            block = content[index]
            block["text" if block["type"] == "text" else "thinking"] = "".join(parts)
        self._parts.clear()  # a later delta starts again from the joined text
        for index in self._dirty_json:
            parts = self._tool_json[index]
            joined = "".join(parts)
            parts[:] = [joined]
            if joined:  # no input at all keeps the `input` of content_block_start, as in the SDK
                try:
                    content[index]["input"] = _parse_tool_input(joined, trailing_strings=self._trailing_strings)
                except ValueError:
                    self._fail("unparseable tool input")
        self._dirty_json.clear()

    def _fail(self, reason: str) -> None:
        if self._failure is None:
            self._failure = reason


def _loads(data: bytes) -> Any:
    if not _LONG_DIGITS.search(data):
        return orjson.loads(data)
    return json.loads(data)  # as the SDK parses events: long integers stay exact


def _dumps(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except TypeError:  # an integer beyond 64 bits
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def _parse_tool_input(text: str, *, trailing_strings: bool) -> Any:
    """The tool input JSON as the SDK's jiter parse leaves it (complete, or cut short by max_tokens)."""
    if not _LONG_DIGITS_STR.search(text):
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:
            pass
    return _PartialJSON(text, trailing_strings).parse()


# --- jiter's partial mode, for tool input cut short ---------------------------------------------------------------
#
# Rarely used (a reply that hit max_tokens inside a tool call), so written for clarity. What jiter 0.19 does with
# JSON that ends early: an unfinished container keeps what it holds so far; an unfinished member or element (a key
# without its value, a number such as `1.` or `-`, a literal such as `tru`, a string) is left out, except that with
# trailing strings an unfinished string value is kept, minus an unfinished escape or a lone high surrogate. At the
# top level an unfinished scalar is an error, and text after a complete value is ignored.

_CHARS = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*'
_STRING = re.compile(f'"{_CHARS}"')
_STRING_START = re.compile(rf'"({_CHARS})(?:\\(?:u[0-9a-fA-F]{{0,3}})?)?')  # group 1: up to an unfinished escape
_SURROGATE = re.compile(r"[\ud800-\udfff]")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_START = re.compile(r"-?(?:(?:0|[1-9][0-9]*)(?:\.[0-9]*)?(?:[eE][+-]?[0-9]*)?)?")
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_LITERALS: dict[str, object] = {
    "true": True,
    "false": False,
    "null": None,
    "NaN": float("nan"),
    "Infinity": float("inf"),
    "-Infinity": float("-inf"),
}


class _Unfinished(Exception):
    """A scalar cut by the end of the text."""


class _PartialJSON:
    def __init__(self, text: str, trailing_strings: bool) -> None:
        self.text = text
        self.trailing_strings = trailing_strings

    def parse(self) -> Any:
        try:
            return self._value(self._skip(0))[0]
        except _Unfinished:
            raise ValueError("unfinished JSON value") from None
        except RecursionError:
            raise ValueError("JSON nested too deeply") from None

    def _skip(self, pos: int) -> int:
        match = _WHITESPACE.match(self.text, pos)
        assert match is not None  # the pattern matches the empty string
        return match.end()

    def _value(self, pos: int) -> tuple[Any, int]:
        text, end = self.text, len(self.text)
        if pos == end:
            raise _Unfinished
        char = text[pos]
        if char == "{":
            return self._object(pos + 1)
        if char == "[":
            return self._array(pos + 1)
        if char == '"':
            return self._string(pos, trailing=self.trailing_strings)
        for literal, value in _LITERALS.items():
            if text.startswith(literal, pos):
                return value, pos + len(literal)
            if end - pos < len(literal) and literal.startswith(text[pos:]):
                raise _Unfinished
        number = _NUMBER.match(text, pos)
        start = _NUMBER_START.match(text, pos)
        if start is not None and start.end() == end and (number is None or number.end() < end):
            raise _Unfinished
        if number is None:
            raise ValueError("invalid JSON value")
        return json.loads(number.group()), number.end()

    def _string(self, pos: int, *, trailing: bool) -> tuple[str, int]:
        text = self.text
        complete = _STRING.match(text, pos)
        if complete is not None:
            value: str = json.loads(complete.group())
            end = complete.end()
        else:
            start = _STRING_START.match(text, pos)
            if start is None or start.end() != len(text):
                raise ValueError("invalid JSON string")
            if not trailing:
                raise _Unfinished
            value = json.loads(f'"{start.group(1)}"')
            if value and "\ud800" <= value[-1] <= "\udbff":
                value = value[:-1]  # its low half was cut off
            end = len(text)
        if _SURROGATE.search(value):
            raise ValueError("lone surrogate in JSON string")
        return value, end

    def _object(self, pos: int) -> tuple[dict[str, Any], int]:
        text, end = self.text, len(self.text)
        result: dict[str, Any] = {}
        pos = self._skip(pos)
        if pos < end and text[pos] == "}":
            return result, pos + 1
        while pos < end:
            if text[pos] != '"':
                raise ValueError("expected a key")
            try:
                key, pos = self._string(pos, trailing=False)  # an unfinished key is left out even so
            except _Unfinished:
                return result, end
            pos = self._skip(pos)
            if pos == end:
                break
            if text[pos] != ":":
                raise ValueError("expected ':'")
            try:
                value, pos = self._value(self._skip(pos + 1))
            except _Unfinished:
                return result, end
            result[key] = value
            pos = self._skip(pos)
            if pos == end:
                break
            if text[pos] == "}":
                return result, pos + 1
            if text[pos] != ",":
                raise ValueError("expected ',' or '}'")
            pos = self._skip(pos + 1)
        return result, end

    def _array(self, pos: int) -> tuple[list[Any], int]:
        text, end = self.text, len(self.text)
        result: list[Any] = []
        pos = self._skip(pos)
        if pos < end and text[pos] == "]":
            return result, pos + 1
        while pos < end:
            try:
                value, pos = self._value(pos)
            except _Unfinished:
                return result, end
            result.append(value)
            pos = self._skip(pos)
            if pos == end:
                break
            if text[pos] == "]":
                return result, pos + 1
            if text[pos] != ",":
                raise ValueError("expected ',' or ']'")
            pos = self._skip(pos + 1)
        return result, end
