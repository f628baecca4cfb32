"""The format each Redis entry's count carries (store/redis_cache.py): what this release writes, and what it reads."""

from __future__ import annotations

import pytest

from statestore.store.cache_entry import CACHE_FORMAT, decode_count, encode_count


def test_this_release_writes_its_format_with_the_version_apart_from_the_count() -> None:
    assert CACHE_FORMAT == 2
    assert encode_count(7) == b"2:7"
    assert encode_count(7, 3) == b"2:7:3"
    assert encode_count(1, -1) == b"2:1:-1"


@pytest.mark.parametrize(("count", "version"), [(0, None), (12, None), (5, 0), (5, 41), (1, -1), (2**40, 2**33)])
def test_what_is_written_reads_back(count: int, version: int | None) -> None:
    assert decode_count(encode_count(count, version)) == (count, version)


def test_a_bare_count_of_the_releases_before_formats_is_read() -> None:
    assert decode_count(b"9") == (9, None)
    assert decode_count(b"0") == (0, None)


@pytest.mark.parametrize("raw", [b"3:9", b"1:9", b"2:", b"2:x", b"2:1:2:3", b"-4", b"", b"9 ", b"2:9:"])
def test_a_format_or_value_this_release_does_not_know_is_not_read(raw: bytes) -> None:
    assert decode_count(raw) is None
