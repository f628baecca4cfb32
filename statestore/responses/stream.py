"""Chat Completions chunks, as they arrive, turned into the Responses streaming events.

The translator only builds events; sequence numbers and SSE framing are the writer's (`sse_event`). Output items
open in the order the backend starts them (text, then each tool call by its index) and all close when the
backend's stream ends, before the commit; `response.completed` is built by the caller after the commit.
"""

from __future__ import annotations

from typing import Any

import orjson

from statestore.responses.errors import BackendError
from statestore.responses.ids import new_id
from statestore.responses.reply import call_item, message_item, status_of, usage_of


class _Text:
    def __init__(self, output_index: int) -> None:
        self.output_index = output_index
        self.item_id = new_id("msg_")
        self.parts: list[str] = []


class _Call:
    def __init__(self, output_index: int, call_id: str | None, name: str) -> None:
        self.output_index = output_index
        self.item_id = new_id("fc_")
        self.call_id = call_id or new_id("call_")
        self.name = name
        self.arguments: list[str] = []


class ChunkTranslator:
    def __init__(self, *, first_index: int = 0) -> None:
        self._first = first_index  # the output index of the first item the backend starts (after a compaction: 1)
        self._opened: list[_Text | _Call] = []
        self._text: _Text | None = None
        self._calls: dict[int, _Call] = {}
        self.finish_reason: object = None
        self.usage: object = None
        self.done = False  # `data: [DONE]` seen

    @property
    def complete(self) -> bool:
        """The backend finished its reply (a finish_reason, and the stream's end marker)."""
        return self.finish_reason is not None and self.done

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        if data.strip() == b"[DONE]":
            self.done = True
            return []
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise BackendError("the model backend sent a malformed stream chunk") from None
        if not isinstance(chunk, dict):
            raise BackendError("the model backend sent a malformed stream chunk")
        if isinstance(chunk.get("error"), dict):
            raise BackendError("the model backend reported an error mid-stream")
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        events: list[dict[str, Any]] = []
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            content = delta.get("content")
            if isinstance(content, str) and content:
                events.extend(self._text_delta(content))
            for call in delta.get("tool_calls") or []:
                if isinstance(call, dict):
                    events.extend(self._call_delta(call))
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        return events

    def _text_delta(self, content: str) -> list[dict[str, Any]]:
        events = []
        if self._text is None:
            self._text = _Text(self._first + len(self._opened))
            self._opened.append(self._text)
            item = message_item("", item_id=self._text.item_id, status="in_progress")
            item["content"] = []
            events.append({"type": "response.output_item.added", "output_index": self._text.output_index, "item": item})
            events.append(
                {
                    "type": "response.content_part.added",
                    "item_id": self._text.item_id,
                    "output_index": self._text.output_index,
                    "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                }
            )
        self._text.parts.append(content)
        events.append(
            {
                "type": "response.output_text.delta",
                "item_id": self._text.item_id,
                "output_index": self._text.output_index,
                "content_index": 0,
                "delta": content,
                "logprobs": [],
            }
        )
        return events

    def _call_delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        index = delta.get("index", 0)
        function = delta.get("function") or {}
        call = self._calls.get(index)
        if call is None:
            name = function.get("name")
            if not isinstance(name, str):
                raise BackendError("the model backend started a tool call without a name")
            call = _Call(self._first + len(self._opened), delta.get("id"), name)
            self._calls[index] = call
            self._opened.append(call)
            item = call_item(call.call_id, call.name, "", item_id=call.item_id, status="in_progress")
            events.append({"type": "response.output_item.added", "output_index": call.output_index, "item": item})
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            call.arguments.append(arguments)
            events.append(
                {
                    "type": "response.function_call_arguments.delta",
                    "item_id": call.item_id,
                    "output_index": call.output_index,
                    "delta": arguments,
                }
            )
        return events

    def finish(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str, dict[str, Any] | None, dict[str, Any]]:
        """(closing events, output items, status, incomplete_details, usage), once the stream completed."""
        events: list[dict[str, Any]] = []
        output: list[dict[str, Any]] = []
        for opened in self._opened:
            if isinstance(opened, _Text):
                text = "".join(opened.parts)
                item = message_item(text, item_id=opened.item_id)
                part = item["content"][0]
                where = {"item_id": opened.item_id, "output_index": opened.output_index, "content_index": 0}
                events.append({"type": "response.output_text.done", **where, "text": text, "logprobs": []})
                events.append({"type": "response.content_part.done", **where, "part": part})
            else:
                arguments = "".join(opened.arguments)
                item = call_item(opened.call_id, opened.name, arguments, item_id=opened.item_id)
                events.append(
                    {
                        "type": "response.function_call_arguments.done",
                        "item_id": opened.item_id,
                        "output_index": opened.output_index,
                        "name": opened.name,
                        "arguments": arguments,
                    }
                )
            events.append({"type": "response.output_item.done", "output_index": opened.output_index, "item": item})
            output.append(item)
        if not output:
            output.append(message_item(""))  # a reply with no text and no call still answers something
        status, incomplete = status_of(self.finish_reason)
        return events, output, status, incomplete, usage_of(self.usage)


class SequencedEvents:
    """Numbers events in the order they are sent and frames them as SSE."""

    def __init__(self) -> None:
        self.next = 0

    def frame(self, event: dict[str, Any]) -> bytes:
        event["sequence_number"] = self.next
        self.next += 1
        kind: str = event["type"]
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"

    def frame_response(self, kind: str, response: bytes) -> bytes:
        """A closing event around the Response's JSON as stored: encoded once, for the store and the client."""
        number = self.next
        self.next += 1
        data = b'{"type":"%s","response":%s,"sequence_number":%d}' % (kind.encode(), response, number)
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


class SocketEvents(SequencedEvents):
    """The same events as WebSocket messages (WebSocket mode on /v1/responses): each event one JSON text, numbered
    as on SSE; the closing event's Response is kept for the connection (`final`)."""

    def __init__(self) -> None:
        super().__init__()
        self.final: bytes | None = None

    def frame(self, event: dict[str, Any]) -> bytes:
        event["sequence_number"] = self.next
        self.next += 1
        return orjson.dumps(event)

    def frame_response(self, kind: str, response: bytes) -> bytes:
        self.final = response
        number = self.next
        self.next += 1
        return b'{"type":"%s","response":%s,"sequence_number":%d}' % (kind.encode(), response, number)
