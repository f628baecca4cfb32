"""A thread's row as a commit leaves it in Redis for the next claimed continue (store/thread_claims.py): read back as
it was written, or not at all."""

from __future__ import annotations

import dataclasses

import pytest

from statestore.store.thread_claims import decode_row, encode_row
from statestore.store.turn_records import HeadAfter, LeasedThread

FIXED = LeasedThread(
    id="thr_1",
    session_id="my-session",
    system=b'"be brief \\u00e9"',
    tools=b'[{"name":"t","input_schema":{"type":"object"}}]',
    system_fp="sfp",
    tools_fp="tfp",
    output_config_fp=None,
    fixed_markers=2,
    head_position=0,
    byte_count=0,
    ttl_seconds=60,
    owner="owner-1",
    tenant_id="tenant-a",
    metadata_user_id=None,
)
AFTER = HeadAfter(
    head_position=6,
    byte_count=1234,
    ttl_seconds=300,
    expires_ms=1_900_000_000_000,
    base_position=2,
    base_bytes=400,
    head_bytes=90,
    context_tokens=777,
    metadata_user_id="user-9",
)


def test_a_row_reads_back_as_the_fixed_fields_with_what_the_commit_returned() -> None:
    raw = encode_row(FIXED, AFTER, "msg_thr_1_6")
    assert raw is not None
    decoded = decode_row(raw)
    assert decoded is not None
    head, expires_ms, leased = decoded
    assert (head, expires_ms) == ("msg_thr_1_6", AFTER.expires_ms)
    expected = dataclasses.replace(
        FIXED,
        head_position=6,
        byte_count=1234,
        ttl_seconds=300,
        base_position=2,
        base_bytes=400,
        head_bytes=90,
        context_tokens=777,
        metadata_user_id="user-9",
    )
    assert leased == expected


def test_a_thread_without_system_or_tools_reads_back_without_them() -> None:
    raw = encode_row(dataclasses.replace(FIXED, system=None, tools=None), AFTER, "m")
    assert raw is not None
    decoded = decode_row(raw)
    assert decoded is not None and decoded[2].system is None and decoded[2].tools is None


def test_system_bytes_that_are_not_text_keep_no_row() -> None:
    assert encode_row(dataclasses.replace(FIXED, system=b"\xff\xfe"), AFTER, "m") is None


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"2:[]",  # another format
        b"1:not json",
        b"1:[1, 2, 3]",  # another field count
        b'1:["m", 1, "thr", "o", null, null, null, 5, null, null, null, null, 0, 0, 0, 0, 0, 0, 0, 0]',  # system no str
    ],
)
def test_a_row_this_code_cannot_read_is_a_miss(raw: bytes) -> None:
    assert decode_row(raw) is None
