"""The one stored form of the rows kept in Redis beside cached contexts (store/redis_rows.py): read back as written,
and anything else (another format, bytes that are not a row of the width asked) a miss. The form is pinned byte for
byte: replicas of two releases read each other's rows during a rolling upgrade."""

from __future__ import annotations

import pytest

from statestore.store.redis_rows import decode_fields, encode_fields

FIELDS = ["msg_thr_1_6", 1_900_000_000_000, None, "be brief \u00e9", 0, "00ff"]


def test_a_row_reads_back_as_it_was_written() -> None:
    assert decode_fields(encode_fields(FIELDS), len(FIELDS)) == FIELDS


def test_the_stored_form_is_the_format_then_a_json_array() -> None:
    assert encode_fields(["a", 1, None, "\u00e9"]) == b'1:["a",1,null,"\xc3\xa9"]'


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b'2:["a",1,null,"x","y","z"]',  # another format, whatever follows
        b'["a",1,null,"x","y","z"]',  # no format
        b"1:not json",
        b'1:{"a":1}',  # not an array
        b'1:"a"',
        b"1:[1,2,3]",  # another width
    ],
)
def test_anything_else_is_a_miss(raw: bytes) -> None:
    assert decode_fields(raw, len(FIELDS)) is None
