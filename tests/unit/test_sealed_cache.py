"""The sealed history cache without a live service: frames, the count formats each family reads, appends and moves
of one frame each, and a read that opens all of an entry's frames at once (store/sealed_cache.py)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from statestore.content_keys import CLEAR, ContentSealer, Scope
from statestore.encryption.content import ScopeSealer
from statestore.errors import UnopenableContent
from statestore.store.cache_entry import (
    CachedHistory,
    decode_count,
    decode_sealed_count,
    encode_count,
    encode_sealed_count,
    thread_key,
)
from statestore.store.memory_cache import MemoryHistoryCache
from statestore.store.sealed_cache import CACHE_DATA, SealedCache, sealed_frame, split_frames

KEY = thread_key("thr_sealed")


def frame(value: bytes) -> bytes:
    return len(value).to_bytes(4, "big") + value


TTL = 60_000


class _Keys:
    """One scope's key, opening through the real AES-GCM sealer; counts its open_many calls."""

    def __init__(self) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self.cipher = AESGCM(AESGCM.generate_key(bit_length=256))
        self.sealer_ = ScopeSealer(b"k" * 16, self.cipher)
        self.calls = 0

    @property
    def enabled(self) -> bool:
        return True

    async def sealer(self, scope: Scope) -> ContentSealer:
        return self.sealer_

    async def open(self, value: bytes, associated: bytes, *, row: str) -> bytes:
        return (await self.open_many([value], [associated], row=row))[0]

    async def open_many(
        self, values: Sequence[bytes | memoryview], associated: Sequence[bytes], *, row: str
    ) -> list[bytes]:
        self.calls += 1
        out = []
        for value, data in zip(values, associated, strict=True):
            try:
                out.append(self.cipher.decrypt(value[20:32], value[32:], data))
            except Exception:
                raise UnopenableContent("stored content does not open") from None
        return out

    async def erase(self, *, tenant_id: str | None, user_id: str | None, resumed: bool = False) -> int:
        return 0

    async def start_problem(self) -> str | None:
        return None


def test_frames_round_trip() -> None:
    values = [b"", b"a", b"x" * 70_000]
    data = b"".join(frame(value) for value in values)
    assert data[:4] == b"\x00\x00\x00\x00"
    split = split_frames(data)
    assert split is not None and [bytes(view) for view in split] == values
    assert all(view.obj is data for view in split)  # views of the entry, nothing copied
    assert split_frames(b"") == []


def test_a_sealed_frame_is_the_frame_of_a_sealed_value() -> None:
    keys = _Keys()
    for plaintext in (b"m1", b"x" * 100_000):
        (value,) = split_frames(sealed_frame(keys.sealer_, plaintext)) or []
        assert keys.cipher.decrypt(value[20:32], value[32:], CACHE_DATA) == plaintext
    assert sealed_frame(CLEAR, b"m1") == frame(b"m1")


@pytest.mark.parametrize("data", [b"\x00\x00\x00", b"\x00\x00\x00\x05abc", frame(b"ok") + b"\x00"])
def test_a_torn_entry_is_not_frames(data: bytes) -> None:
    assert split_frames(data) is None


def test_each_family_reads_its_own_count_format() -> None:
    assert decode_sealed_count(encode_sealed_count(7)) == (7, None)
    assert decode_sealed_count(encode_sealed_count(7, 3)) == (7, 3)
    assert decode_sealed_count(encode_count(7)) is None
    assert decode_sealed_count(b"7") is None
    assert decode_count(encode_sealed_count(7)) is None
    assert decode_count(encode_sealed_count(7, 3)) is None


async def test_put_append_move_and_get_open_all_frames_at_once() -> None:
    keys = _Keys()
    memory = MemoryHistoryCache()
    cache = SealedCache(memory, keys)
    sealer = keys.sealer_
    await cache.put(KEY, CachedHistory(2, b"m1,m2"), TTL, sealer=sealer)
    await cache.append(KEY, 2, [b"m3", b"m4"], TTL, sealer=sealer)
    moved = thread_key("thr_moved")
    assert await cache.move(KEY, moved, 4, [b"m5"], TTL, sealer=sealer)
    assert await cache.get(KEY) is None
    got = await cache.get(moved)
    assert got == CachedHistory(5, b"m1,m2,m3,m4,m5", None, frames=3)
    assert keys.calls == 1
    raw = await memory.get_raw(moved)
    assert raw is not None and raw[0] == b"3:5" and b"m1" not in raw[1]
    # A clear reader of the same store sees nothing; a sealed reader sees no clear entry.
    assert await memory.get(moved) is None
    await memory.put(KEY, CachedHistory(1, b"clear"), TTL, sealer=CLEAR)
    assert await cache.get(KEY) is None
    # An append to an entry of the other family drops it.
    await cache.append(KEY, 1, [b"x"], TTL, sealer=sealer)
    assert await memory.get(KEY) is None


async def test_an_empty_entry_and_a_stale_append() -> None:
    keys = _Keys()
    cache = SealedCache(MemoryHistoryCache(), keys)
    await cache.put(KEY, CachedHistory(0, b""), TTL, sealer=keys.sealer_)
    assert await cache.get(KEY) == CachedHistory(0, b"", None, frames=0)
    await cache.append(KEY, 0, [b"first"], TTL, sealer=keys.sealer_)
    assert await cache.get(KEY) == CachedHistory(1, b"first", None, frames=1)
    await cache.append(KEY, 5, [b"late"], TTL, sealer=keys.sealer_)
    assert await cache.get(KEY) is None


async def test_a_frame_that_does_not_open_is_a_miss_and_is_dropped() -> None:
    keys = _Keys()
    memory = MemoryHistoryCache()
    cache = SealedCache(memory, keys)
    other = _Keys()
    await memory.put_raw(KEY, b"3:1", frame(other.sealer_.seal(b"m1", CACHE_DATA)), TTL)
    assert await cache.get(KEY) is None
    assert await memory.get_raw(KEY) is None
