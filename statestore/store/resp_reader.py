"""Redis's replies (RESP2) read from the chunks a connection receives, as hiredis's Reader gives them: bulk strings as
bytes, status replies as bytes, integers, nil as None, arrays as lists, error replies as `RespError` values.

Why not hiredis's Reader: it copies every byte received into a buffer of its own (grown by reallocation, copying
again) and then into the reply's bytes object. A cached history is one bulk string, 800 KB at 200k tokens, arriving
in some dozen chunks: here a bulk string that spans chunks is kept as views of them and joined once, when its last
byte arrives, so a turn's history is copied once instead of three or four times (tests/unit/test_resp_reader.py holds
the two readers side by side on random replies cut at random places).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class RespError(Exception):
    """An error reply from Redis (its text never carries stored values)."""


class RedisConnectionError(ConnectionError):
    """Redis cannot be reached: a connection refused, lost or closed, or skipped by the breaker (store/resp.py)."""


class RedisTimeout(TimeoutError):
    """Redis did not answer in time (the connection is then dropped: a late reply would meet the wrong request)."""


class RespProtocolError(RedisConnectionError):
    """Bytes that are not RESP2: the connection cannot be trusted any further."""


_CRLF = b"\r\n"
_BULK, _ARRAY, _INTEGER, _STATUS, _ERROR = b"$"[0], b"*"[0], b":"[0], b"+"[0], b"-"[0]


class RespReader:
    """Feed it the chunks in order; each complete reply is handed to `on_reply` as soon as its last byte is fed."""

    def __init__(self, on_reply: Callable[[Any], None]) -> None:
        self._on_reply = on_reply
        self._line = b""  # the start of a header line cut by the end of the last chunk
        self._open: list[tuple[list[Any], int]] = []  # arrays being filled: (items so far, items in all)
        self._parts: list[bytes | memoryview] | None = None  # a bulk string spanning chunks, as received
        self._missing = 0  # bytes of that bulk string still to come
        self._skip = 0  # bytes of the CRLF after a bulk string still to come

    def feed(self, data: bytes) -> None:
        if self._line:
            data, self._line = self._line + data, b""
        pos, end_of_data = 0, len(data)
        if self._parts is not None:
            take = min(end_of_data, self._missing)
            self._parts.append(memoryview(data)[:take] if take < end_of_data else data)
            self._missing -= take
            pos = take
            if self._missing:
                return
            value = b"".join(self._parts)
            self._parts = None
            self._skip = 2
            self._complete(value)
        if self._skip:
            skipped = min(self._skip, end_of_data - pos)
            pos += skipped
            self._skip -= skipped
            if self._skip:
                return
        while pos < end_of_data:
            line_end = data.find(_CRLF, pos)
            if line_end < 0:
                self._line = data[pos:]
                return
            kind = data[pos]
            if kind == _BULK:
                length = self._number(data, pos, line_end)
                pos = line_end + 2
                if length < 0:
                    self._complete(None)
                elif end_of_data - pos >= length + 2:
                    self._complete(data[pos : pos + length])
                    pos += length + 2
                else:
                    available = min(length, end_of_data - pos)
                    if available == length:  # all of the value is here; only (part of) its CRLF is not
                        self._complete(data[pos : pos + length])
                    else:  # the start of a long value: kept as a view, joined once complete
                        self._parts = [memoryview(data)[pos:]]
                        self._missing = length - available
                    self._skip = 2 - (end_of_data - pos - available)
                    return
            elif kind == _ARRAY:
                count = self._number(data, pos, line_end)
                pos = line_end + 2
                if count < 0:
                    self._complete(None)
                elif count == 0:
                    self._complete([])
                else:
                    self._open.append(([], count))
            elif kind == _INTEGER:
                self._complete(self._number(data, pos, line_end))
                pos = line_end + 2
            elif kind == _STATUS:
                self._complete(data[pos + 1 : line_end])
                pos = line_end + 2
            elif kind == _ERROR:
                self._complete(RespError(data[pos + 1 : line_end].decode("utf-8", "replace")))
                pos = line_end + 2
            else:
                raise RespProtocolError(f"redis protocol error: unexpected reply type {chr(kind)!r}")

    @staticmethod
    def _number(data: bytes, pos: int, line_end: int) -> int:
        try:
            return int(data[pos + 1 : line_end])
        except ValueError:
            raise RespProtocolError("redis protocol error: a length or integer is not a number") from None

    def _complete(self, value: Any) -> None:
        while self._open:
            items, count = self._open[-1]
            items.append(value)
            if len(items) < count:
                return
            self._open.pop()
            value = items
        self._on_reply(value)
