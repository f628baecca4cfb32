"""A chain head's row as a commit leaves it in Redis for the next continue (store/response_heads.py): read back as it
was written, or not at all, and served only beside its chain's context, to its owner, before it expires."""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import pytest

from statestore.store.cache_entry import BRANCH_POINT, CachedHistory, encode_count
from statestore.store.resp import RespClient
from statestore.store.response_heads import ResponseHeads, decode_head, encode_head
from statestore.store.response_records import ResponseRow

NOW = 1_800_000_000_000
EXPIRES = NOW + 60_000
ROW = ResponseRow(
    id="resp_2",
    root_id="resp_0",
    depth=2,
    chain_bytes=900,
    body=b"",
    conversation_version=None,
    context_tokens=512,
    context_bytes=2048,
    context_kept=300,
    context_head_id="resp_1",
    context_head=b'{"role":"user","content":"summary \\u00e9 \xc3\xa9"}',
    context_runs=bytes(range(40)),
    expires_ms=EXPIRES,
    owner="owner-1",
)


def test_a_row_reads_back_as_it_was_written() -> None:
    encoded = encode_head(ROW)
    assert encoded is not None
    assert decode_head(encoded) == ROW
    bare = dataclasses.replace(ROW, context_kept=None, context_head_id=None, context_head=None, context_runs=None)
    encoded = encode_head(bare)
    assert encoded is not None and decode_head(encoded) == bare


def test_a_row_that_cannot_be_kept_is_not_written() -> None:
    # a chain begun on a conversation: its version moves with the conversation
    assert encode_head(dataclasses.replace(ROW, conversation_version=7)) is None
    assert encode_head(dataclasses.replace(ROW, context_head=b"\xff\xfe")) is None


@pytest.mark.parametrize("raw", [b"", b"2:[]", b"1:{}", b"1:[1,2]", b'1:["a"]', b"1:not json"])
def test_a_row_this_code_cannot_read_is_a_miss(raw: bytes) -> None:
    assert decode_head(raw) is None


class _Replies:
    """A Redis client whose MGET answers what the test put in."""

    def __init__(self, joined: bytes | None, count: bytes | None, row: bytes | None, *, held: bool = False) -> None:
        self.replies = [count, row] if held else [joined, count, row]
        self.asked: list[tuple[Any, ...]] = []

    async def execute(self, *command: Any) -> list[bytes | None]:
        self.asked.append(command)
        return self.replies


def _heads(client: _Replies) -> ResponseHeads:
    def decode(count: bytes, joined: bytes) -> CachedHistory | None:
        n, _, version = count.decode().removeprefix("2:").partition(":")
        return CachedHistory(int(n), joined, int(version) if version else None)

    return ResponseHeads(cast(RespClient, client), lambda key: (f"{key}:h", f"{key}:n", f"{key}:r"), decode)


async def _read(
    *,
    row: bytes | None,
    count: int = 3,
    version: int | None = None,
    owner: str = "owner-1",
    now: int = NOW,
    held: bool = False,
) -> tuple[ResponseRow | None, CachedHistory | None]:
    client = _Replies(b"a,b,c", encode_count(count, version), row, held=held)
    if held:  # a connection's head, whose context it holds: Redis is asked for the entry's count and row only
        head = await _heads(client).read_held("resp_2", b"a,b,c", owner=owner, now_ms=now)
        assert client.asked == [("MGET", "resp:resp_2:n", "resp:resp_2:r")]
    else:
        head = await _heads(client).read("resp_2", owner=owner, now_ms=now)
        assert client.asked == [("MGET", "resp:resp_2:h", "resp:resp_2:n", "resp:resp_2:r")]
    return head.row, head.cached


@pytest.mark.parametrize("held", [False, True])
async def test_a_row_is_served_beside_its_chains_context(held: bool) -> None:
    row, cached = await _read(row=encode_head(ROW), held=held)
    assert row == ROW and cached == CachedHistory(3, b"a,b,c")
    # a branch point's entry holds the same chain
    row, _ = await _read(row=encode_head(ROW), version=BRANCH_POINT, held=held)
    assert row == ROW


@pytest.mark.parametrize(
    "case",
    ["no row", "expired", "another owner", "another depth", "a conversation's version", "another response's row"],
)
@pytest.mark.parametrize("held", [False, True])
async def test_a_row_is_not_served_otherwise(case: str, held: bool) -> None:
    encoded = encode_head(ROW)
    kwargs: dict[str, Any] = {"row": encoded, "held": held}
    if case == "no row":
        kwargs["row"] = None
    elif case == "expired":
        kwargs["now"] = EXPIRES
    elif case == "another owner":
        kwargs["owner"] = "owner-2"
    elif case == "another depth":
        kwargs["count"] = 4
    elif case == "a conversation's version":
        kwargs["version"] = 5
    else:
        kwargs["row"] = encode_head(dataclasses.replace(ROW, id="resp_9"))
    row, cached = await _read(**kwargs)
    assert row is None
    assert cached is not None  # the context is still the caller's to check against the database's row
