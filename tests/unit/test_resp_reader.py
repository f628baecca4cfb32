"""store/resp_reader.py reads what hiredis's Reader reads, reply for reply, however the bytes are cut into chunks."""

from __future__ import annotations

import random
from typing import Any

import hiredis
import pytest

from statestore.store.resp_reader import RespError, RespProtocolError, RespReader


def _reply(draw: random.Random, depth: int = 0) -> bytes:
    kind = draw.choice(["bulk", "long", "nil", "int", "status", "error", "array", "nil_array", "empty"][: 9 - depth])
    if kind == "bulk":
        value = draw.randbytes(draw.randrange(0, 40)).replace(b"$", b"\r\n$")  # CRLFs inside values too
        return b"$%d\r\n%s\r\n" % (len(value), value)
    if kind == "long":
        value = draw.randbytes(draw.randrange(1_000, 200_000))
        return b"$%d\r\n%s\r\n" % (len(value), value)
    if kind == "nil":
        return b"$-1\r\n"
    if kind == "int":
        return b":%d\r\n" % draw.randrange(-(2**63), 2**63)
    if kind == "status":
        return b"+" + draw.choice([b"OK", b"PONG", b"QUEUED"]) + b"\r\n"
    if kind == "error":
        return b"-" + draw.choice([b"ERR wrong", b"WRONGTYPE Operation", b"NOSCRIPT No matching script"]) + b"\r\n"
    if kind == "array":
        items = [_reply(draw, depth + 1) for _ in range(draw.randrange(1, 5))]
        return b"*%d\r\n" % len(items) + b"".join(items)
    if kind == "nil_array":
        return b"*-1\r\n"
    return b"*0\r\n"


def _plain(value: Any) -> Any:
    """Replies comparable across the two readers (an error reply as its type and text)."""
    if isinstance(value, RespError):
        return ("error", str(value))
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value


def _cut(stream: bytes, draw: random.Random) -> list[bytes]:
    cuts = sorted(draw.sample(range(1, len(stream)), min(len(stream) - 1, draw.randrange(0, 40))))
    # cut at 1-byte pieces too: inside a header, between a value's CR and LF
    return [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]


@pytest.mark.parametrize("seed", range(40))
def test_replies_cut_anywhere_read_as_hiredis_reads_them(seed: int) -> None:
    draw = random.Random(seed)
    stream = b"".join(_reply(draw) for _ in range(draw.randrange(1, 12)))
    theirs = hiredis.Reader(replyError=RespError)
    theirs.feed(stream)
    expected = []
    while (reply := theirs.gets()) is not False:
        expected.append(_plain(reply))
    ours: list[Any] = []
    reader = RespReader(lambda reply: ours.append(_plain(reply)))
    for chunk in _cut(stream, draw):
        reader.feed(chunk)
    assert ours == expected
    assert len(ours) > 0


def test_a_long_value_is_whole_only_once_its_last_byte_arrives() -> None:
    value = bytes(range(256)) * 4096  # 1 MiB
    got: list[Any] = []
    reader = RespReader(got.append)
    stream = b"*2\r\n$%d\r\n%s\r\n:7\r\n" % (len(value), value)
    for start in range(0, len(stream) - 1, 65536):
        reader.feed(stream[start : min(start + 65536, len(stream) - 1)])
        assert got == []
    reader.feed(stream[-1:])
    assert got == [[value, 7]]
    assert isinstance(got[0][0], bytes)


@pytest.mark.parametrize("garbage", [b"?what\r\n", b"$x\r\n", b":1.5\r\n"])
def test_bytes_that_are_not_resp_are_a_protocol_error(garbage: bytes) -> None:
    with pytest.raises(RespProtocolError):
        RespReader(lambda _: None).feed(garbage)
