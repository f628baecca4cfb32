"""Capture of a streamed Messages reply: `ReplyAccumulator` rebuilds the final Message from the SSE events the way the
official SDK's `accumulate_event` (anthropic 2.14.0, `lib/streaming/_beta_messages.py`) does, but on plain JSON
dicts, and re-encodes `message_start` with the id statestore minted. The captured message may hold integers beyond
64 bits, as the SDK's would: `orjson.dumps` refuses those.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jiter
import orjson

from statestore.upstream.sse import SSEEvent

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
        "_model",
        "_parts",
        "_stopped",
        "_tool_json",
        "_trailing_strings",
        "backend_id",
        "error_seen",
    )

    def __init__(self, message_id: str, *, anthropic_beta: str = "", model: str | None = None) -> None:
        """`message_id`: the id statestore minted. `anthropic_beta`: the request's `anthropic-beta` header, which
        decides, as in the SDK, how a tool input cut short (max_tokens) is parsed. `model`: given, a stream that
        opens a content block with no `message_start` before it gets one, for this model (llama.cpp's server sends
        `message_start` with its first token's text, and none when that token is part of a UTF-8 character)."""
        self._message_id = message_id
        self._model = model
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
    def captured(self) -> bool:
        """Everything so far was captured: started, no `error` event, nothing malformed. At `message_stop`, before
        `add()` of it, this says whether the reply is whole."""
        return self._message is not None and not self.error_seen and self.failure is None

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
            elif kind == "content_block_start" and self._model is not None:
                opened = self._start("message_start", _missing_start(self._model))
                self._apply(kind, payload)
                return opened + event.raw
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
                    # The SDK's own parse (jiter's partial mode), so a cut input is kept exactly as the client's is.
                    content[index]["input"] = jiter.from_json(
                        joined.encode(), partial_mode="trailing-strings" if self._trailing_strings else True
                    )
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


def _missing_start(model: str) -> dict[str, Any]:
    """The `message_start` a stream left out: what the backend would have said before its first block, but the
    prompt's token count, which only it knew (the turn's usage counts none)."""
    message: dict[str, Any] = {"type": "message", "role": "assistant", "content": [], "model": model}
    message |= {"stop_reason": None, "stop_sequence": None, "usage": {"output_tokens": 0}}
    return {"type": "message_start", "message": message}
