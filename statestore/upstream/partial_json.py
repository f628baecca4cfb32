"""Tool input JSON as the SDK's jiter parse leaves it, complete or cut short by max_tokens."""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

_LONG_DIGITS_STR = re.compile(r"[0-9]{19}")


def parse_tool_input(text: str, *, trailing_strings: bool) -> Any:
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
