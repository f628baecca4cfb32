"""Incremental SSE framing, on the hot path of every streamed turn.

`SSEParser` cuts the backend's bytes into events as they arrive, keeping each event's exact bytes so the relay can
forward them unchanged; `upstream.reply_capture.ReplyAccumulator` rebuilds the reply from them. Typical use by the
relay:

    parser, reply = SSEParser(), ReplyAccumulator(minted_id, anthropic_beta=request_beta_header)
    async for chunk in backend_stream:
        for event in parser.feed(chunk):
            out = reply.add(event)
            if reply.stopped and not committed:   # `out` is message_stop: commit before the client sees it
                ...commit reply.message if reply.complete (and policy allows)...
            await send(out)
    parser.close()  # a cut stream leaves an incomplete event behind: it is dropped, never forwarded

(`event.event == "message_stop"` tells the same before `add()`; everything before it has been captured by then.)
"""

from __future__ import annotations

import re
from typing import NamedTuple

__all__ = ["SSEEvent", "SSEParser", "is_error_event"]


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
