"""The rows kept in Redis beside cached contexts (a thread's row, store/thread_claims.py; a chain head's,
store/response_heads.py), written by the script that writes their context (store/cache_scripts.py): one stored form
for both. A row is its format, then its fields as a JSON array.

The form is read across replicas of different releases during a rolling upgrade, so it never changes in place: a
new one takes a new format, and a reader that meets a format it does not know (or a row it cannot read) treats it as
a miss and reads the database, as it does for no row at all."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import orjson

FORMAT: Final = b"1:"


def encode_fields(fields: Sequence[object]) -> bytes:
    """The stored form of a row's fields, in their order (each one JSON can hold)."""
    return FORMAT + orjson.dumps(fields)


def decode_fields(raw: bytes, width: int) -> list[Any] | None:
    """The `width` fields of a stored row, in their order; None for another format, bytes that are not a JSON array,
    or an array of another width. The fields' types are the reader's to check."""
    if not raw.startswith(FORMAT):
        return None
    try:
        fields = orjson.loads(memoryview(raw)[len(FORMAT) :])
    except orjson.JSONDecodeError:
        return None
    return fields if type(fields) is list and len(fields) == width else None
