"""Encryption at rest, the keys (statestore/encryption/, statestore/store/keystore.py) on a SQLite key store in a
temporary directory: a value opens only for its row, under a key the key store still holds; a scope has one data key,
made once however many replicas ask at the same moment; an erasure destroys keys and this process forgets them at
once; the start-up check names what is wrong; rotation moves every data key to the newest master key; and no error
ever carries a key's bytes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from statestore.content_keys import MAGIC, Scope, is_sealed, row_data
from statestore.encryption.content import ClearContent, ScopeSealer, SealedContent
from statestore.encryption.master_keys import MasterKeyRing, read_master_keys
from statestore.errors import ContentErased, UnopenableContent
from statestore.sealing import new_key_text, parse_keys
from statestore.store.engine import create_engine
from statestore.store.keystore import KeyStore, StoredKey

ALICE = Scope(owner="own_alice", tenant_id="ten_a", user_id=None)
ALICE_U1 = Scope(owner="own_alice", tenant_id="ten_a", user_id="u1")
BOB = Scope(owner="own_bob", tenant_id="ten_b", user_id="u1")


def ring_text(*ids: str) -> tuple[str, dict[str, str]]:
    keys = {key_id: new_key_text() for key_id in ids}
    return ",".join(f"{k}:{v}" for k, v in keys.items()), keys


def ring(text: str) -> MasterKeyRing:
    return MasterKeyRing(parse_keys(text))


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[AsyncEngine]:
    made = create_engine(f"sqlite+aiosqlite:///{tmp_path / 'keys.db'}", pool_size=4)
    await KeyStore(made).create_table()
    yield made
    await made.dispose()


PAUSES: list[float] = []  # what erasures waited (recorded, not slept)


async def _recorded_pause(seconds: float) -> None:
    PAUSES.append(seconds)


def sealed(engine: AsyncEngine, keys: str, remember: float = 30.0) -> SealedContent:
    return SealedContent(
        KeyStore(engine),
        ring(keys),
        clock=lambda: 1_000,
        remember_seconds=remember,
        settle_seconds=6.0,
        pause=_recorded_pause,
    )


async def test_an_erasure_waits_out_every_replicas_memory_of_its_keys_before_rows_go(engine: AsyncEngine) -> None:
    """Another replica may seal under a destroyed key until it forgets it: the erasure's row deletion must come after,
    so it takes those rows too. No key destroyed: nothing to wait for."""
    keys = f"k1:{new_key_text()}"
    content = sealed(engine, keys, remember=12.0)
    PAUSES.clear()
    assert await content.erase(tenant_id=None, user_id="nobody") == 0
    assert PAUSES == []
    await content.sealer(Scope("t:ten_a", "ten_a", "u9"))
    assert await content.erase(tenant_id=None, user_id="u9") == 1
    assert PAUSES == [18.0]
    # Taken up after its process stopped, an erasure finds the keys destroyed already (that process may have destroyed
    # them moments before): it waits all the same.
    assert await content.erase(tenant_id=None, user_id="u9", resumed=True) == 0
    assert PAUSES == [18.0, 18.0]


async def test_a_value_round_trips_and_carries_no_plaintext(engine: AsyncEngine) -> None:
    keys, _ = ring_text("k1")
    content = sealed(engine, keys)
    data = row_data("thread_messages", "own_alice", "thr_1", 3)
    value = (await content.sealer(ALICE)).seal(b'{"text":"MARKER secret"}', data)
    assert is_sealed(value) and value.startswith(MAGIC) and b"MARKER" not in value
    assert await content.open(value, data, row="thr_1/3") == b'{"text":"MARKER secret"}'
    # Another replica, with the same master keys and nothing remembered, opens it from the key store.
    assert await sealed(engine, keys).open(value, data, row="thr_1/3") == b'{"text":"MARKER secret"}'


async def test_open_many_opens_values_of_several_scopes_and_clear_ones(engine: AsyncEngine) -> None:
    keys, _ = ring_text("k1")
    content = sealed(engine, keys)
    datas = [row_data("t", i) for i in range(3)]
    values = [
        (await content.sealer(ALICE)).seal(b"a", datas[0]),
        b'{"stored before encryption":1}',
        (await content.sealer(BOB)).seal(b"b", datas[2]),
    ]
    assert await sealed(engine, keys).open_many(values, datas, row="r") == [b"a", values[1], b"b"]


async def test_a_cache_entrys_frames_open_from_views_of_it(engine: AsyncEngine) -> None:
    """A long entry's frames (one put whole, then appended tails, of two scopes after a move) open from views of the
    entry's bytes; a view of other associated data, a damaged frame or a cut one does not open."""
    keys, _ = ring_text("k1")
    content = sealed(engine, keys)
    alice, bob = await content.sealer(ALICE), await content.sealer(BOB)
    parts = [b"x" * 300_000, b",m2", b",m3"]
    entry = b"".join(sealer.seal(part, b"cache") for sealer, part in zip((alice, alice, bob), parts, strict=True))
    view = memoryview(entry)
    at = [0, len(parts[0]) + 48, len(parts[0]) + 48 + 51, len(entry)]
    views = [view[at[i] : at[i + 1]] for i in range(3)]
    assert await sealed(engine, keys).open_many(views, [b"cache"] * 3, row="r") == parts
    with pytest.raises(UnopenableContent):
        await content.open_many(views, [b"cache", b"other", b"cache"], row="r")
    damaged = bytearray(entry)
    damaged[at[2] - 1] ^= 1
    with pytest.raises(UnopenableContent):
        await content.open_many([memoryview(damaged)[at[1] : at[2]]], [b"cache"], row="r")
    with pytest.raises(UnopenableContent):
        await content.open_many([views[0][:30]], [b"cache"], row="r")


@pytest.mark.parametrize(
    "moved",
    [
        row_data("thread_messages", "own_alice", "thr_1", 4),  # another position
        row_data("thread_messages", "own_bob", "thr_1", 3),  # another owner
        row_data("thread_messages", "own_alice", "thr_2", 3),  # another row
        b"",
    ],
)
async def test_a_value_moved_to_another_row_does_not_open(engine: AsyncEngine, moved: bytes) -> None:
    content = sealed(engine, ring_text("k1")[0])
    value = (await content.sealer(ALICE)).seal(b"MARKER", row_data("thread_messages", "own_alice", "thr_1", 3))
    with pytest.raises(UnopenableContent) as raised:
        await content.open(value, moved, row="thr_2/3")
    assert "MARKER" not in str(raised.value)


@pytest.mark.parametrize("cut", [1, 20, 40])
async def test_a_damaged_or_cut_value_does_not_open(engine: AsyncEngine, cut: int) -> None:
    content = sealed(engine, ring_text("k1")[0])
    value = (await content.sealer(ALICE)).seal(b"MARKER", b"row")
    with pytest.raises(UnopenableContent):
        await content.open(value[:-cut], b"row", row="r")
    # A flipped nonce, ciphertext or tag byte (a flipped key id reads as a key no longer held: an erased scope's).
    flipped = bytearray(value)
    flipped[len(MAGIC) + 16 + cut % 12] ^= 1
    with pytest.raises(UnopenableContent):
        await content.open(bytes(flipped), b"row", row="r")
    flipped = bytearray(value)
    flipped[-min(cut, 20)] ^= 1
    with pytest.raises(UnopenableContent):
        await content.open(bytes(flipped), b"row", row="r")


async def test_an_erased_scope_does_not_open_and_this_process_forgets_its_key_at_once(engine: AsyncEngine) -> None:
    keys, _ = ring_text("k1")
    content = sealed(engine, keys, remember=3600)  # remembered for an hour: only erase() can make it forget
    other = sealed(engine, keys, remember=3600)
    mine = (await content.sealer(ALICE_U1)).seal(b"MARKER", b"row")
    bobs = (await content.sealer(BOB)).seal(b"bob", b"row")
    assert await content.open(mine, b"row", row="r") == b"MARKER"  # remembered by id as well as by scope
    assert await content.erase(tenant_id=None, user_id="u1") == 2  # alice's u1 scope and bob's (same user id)
    with pytest.raises(ContentErased):
        await content.open(mine, b"row", row="r")
    with pytest.raises(ContentErased):
        await content.open(bobs, b"row", row="r")
    with pytest.raises(ContentErased):
        await other.open(mine, b"row", row="r")  # another replica that never held the key
    # The scope starts again under a new key; the old values stay erased.
    fresh = await content.sealer(ALICE_U1)
    assert isinstance(fresh, ScopeSealer) and fresh.key_id != mine[len(MAGIC) : len(MAGIC) + 16]
    with pytest.raises(ContentErased):
        await content.open(mine, b"row", row="r")


async def test_erasing_a_scope_only_remembered_as_a_sealer_forgets_it(engine: AsyncEngine) -> None:
    keys, _ = ring_text("k1")
    content = sealed(engine, keys, remember=3600)
    first = await content.sealer(ALICE)
    assert isinstance(first, ScopeSealer)
    content._by_id.clear()  # only the sealer is remembered (its key id not looked up since)
    assert await content.erase(tenant_id="ten_a", user_id=None) == 1
    again = await content.sealer(ALICE)
    assert isinstance(again, ScopeSealer) and again.key_id != first.key_id


async def test_an_erasure_by_tenant_and_user_destroys_only_that_combination(engine: AsyncEngine) -> None:
    content = sealed(engine, ring_text("k1")[0])
    for scope in (ALICE, ALICE_U1, BOB):
        await content.sealer(scope)
    assert await content.erase(tenant_id="ten_a", user_id="u1") == 1
    assert await KeyStore(engine).count_by_master() == {"k1": 2}
    with pytest.raises(ValueError, match="criterion"):
        await content.erase(tenant_id=None, user_id=None)


async def test_two_scopes_get_two_keys_and_one_scope_one_key(engine: AsyncEngine) -> None:
    content = sealed(engine, ring_text("k1")[0])
    a, a_again, a_u1, b = [await content.sealer(s) for s in (ALICE, ALICE, ALICE_U1, BOB)]
    assert isinstance(a, ScopeSealer) and isinstance(a_again, ScopeSealer)
    assert isinstance(a_u1, ScopeSealer) and isinstance(b, ScopeSealer)
    assert a.key_id == a_again.key_id
    assert len({a.key_id, a_u1.key_id, b.key_id}) == 3
    assert await KeyStore(engine).count_by_master() == {"k1": 3}


async def test_replicas_asking_for_a_new_scope_at_once_share_one_key(engine: AsyncEngine) -> None:
    keys, _ = ring_text("k1")
    replicas = [sealed(engine, keys) for _ in range(8)]
    sealers = await asyncio.gather(*(r.sealer(ALICE) for r in replicas))
    assert len({s.key_id for s in sealers if isinstance(s, ScopeSealer)}) == 1
    assert await KeyStore(engine).count_by_master() == {"k1": 1}
    value = sealers[3].seal(b"x", b"row")
    assert [await r.open(value, b"row", row="r") for r in replicas] == [b"x"] * 8


async def test_the_start_check_names_a_missing_master_key(engine: AsyncEngine) -> None:
    keys, given = ring_text("k2", "k1")
    await sealed(engine, f"k1:{given['k1']}").sealer(ALICE)  # made under k1 alone
    await sealed(engine, keys).sealer(BOB)  # under k2
    assert await sealed(engine, keys).start_problem() is None
    problem = await sealed(engine, f"k2:{given['k2']}").start_problem()
    assert problem is not None and "'k1'" in problem and "1 data key" in problem
    assert given["k1"] not in problem and given["k2"] not in problem


async def test_the_start_check_names_a_wrong_key_under_a_known_id(engine: AsyncEngine) -> None:
    keys, given = ring_text("k1")
    await sealed(engine, keys).sealer(ALICE)
    wrong = f"k1:{new_key_text()}"
    problem = await sealed(engine, wrong).start_problem()
    assert problem is not None and "'k1'" in problem and "not the key" in problem
    assert given["k1"] not in problem and wrong[3:] not in problem


async def test_clear_content_refuses_a_key_store_with_keys_and_starts_on_an_empty_one(engine: AsyncEngine) -> None:
    clear = ClearContent(KeyStore(engine))
    assert await clear.start_problem() is None
    keys, given = ring_text("k1")
    value = (await sealed(engine, keys).sealer(ALICE)).seal(b"MARKER", b"row")
    problem = await clear.start_problem()
    assert problem is not None and "k1" in problem and "STATESTORE_ENCRYPTION_KEYS" in problem
    assert given["k1"] not in problem
    # Were it started anyway, a sealed value is refused, never served; a clear one passes.
    with pytest.raises(UnopenableContent):
        await clear.open(value, b"row", row="r")
    assert await clear.open(b'{"a":1}', b"row", row="r") == b'{"a":1}'
    assert await clear.erase(tenant_id="ten_a", user_id=None) == 1


async def test_rotate_rewraps_every_key_so_the_old_master_key_can_go(engine: AsyncEngine) -> None:
    old, _ = ring_text("k1")
    before = sealed(engine, old)
    values = []
    for i in range(23):
        scope = Scope(owner=f"own_{i}", tenant_id="ten_a", user_id=str(i % 3))
        values.append(((await before.sealer(scope)).seal(f"value {i}".encode(), row_data("t", i)), row_data("t", i)))
    new_key = new_key_text()
    both = f"k2:{new_key},{old}"
    rotating = sealed(engine, both)
    assert await rotating.rotate(batch_size=5) == 23
    assert await KeyStore(engine).count_by_master() == {"k2": 23}
    assert await rotating.rotate(batch_size=5) == 0  # safe to run twice
    after = sealed(engine, f"k2:{new_key}")  # the old master key removed from the ring
    assert await after.start_problem() is None
    opened = await after.open_many([v for v, _ in values], [d for _, d in values], row="r")
    assert opened == [f"value {i}".encode() for i in range(23)]


async def test_two_rotations_at_once_move_each_key_once(engine: AsyncEngine) -> None:
    old, _ = ring_text("k1")
    for i in range(30):
        await sealed(engine, old).sealer(Scope(owner=f"own_{i}", tenant_id=None, user_id=None))
    both = f"k2:{new_key_text()},{old}"
    moved = await asyncio.gather(sealed(engine, both).rotate(batch_size=4), sealed(engine, both).rotate(batch_size=4))
    assert sum(moved) == 30
    assert await KeyStore(engine).count_by_master() == {"k2": 30}


def test_master_keys_from_the_environment_or_a_file(tmp_path: Path) -> None:
    text, _ = ring_text("k2", "k1")
    assert read_master_keys(None, None) is None
    assert read_master_keys("  ", None) is None
    from_env = read_master_keys(text, None)
    assert from_env is not None and from_env.ids == ["k2", "k1"] and from_env.newest_id == "k2"
    path = tmp_path / "keys"
    path.write_text(text.replace(",", "\n") + "\n")
    from_file = read_master_keys(None, path)
    assert from_file is not None and from_file.ids == ["k2", "k1"]


def test_master_key_errors_never_show_a_key(tmp_path: Path) -> None:
    key = new_key_text()
    path = tmp_path / "keys"
    path.write_text(f"k1:{key}")
    cases: list[tuple[str | None, Path | None, str]] = [
        (f"k1:{key}", path, "not both"),
        (None, tmp_path / "missing", "cannot read"),
        (None, tmp_path, "cannot read"),  # a directory
        (key, None, "expected id:key"),  # the id forgotten
        (f"{key}:k1", None, "entry 1"),  # id and key swapped
        (f"k1:{key[:32]}", None, "32 bytes"),  # cut short
        (f"k1:{key}!", None, "base64"),
        (f"k1:{key},k1:{new_key_text()}", None, "twice"),
        (f"this id is far too long:{key}", None, "key id"),
    ]
    for inline, file, expected in cases:
        with pytest.raises(ValueError) as raised:
            read_master_keys(inline, file)
        message = str(raised.value)
        assert expected in message
        for length in (8, 12):
            assert all(key[i : i + length] not in message for i in range(len(key) - length)), message


def test_a_binary_key_file_is_refused_without_its_bytes(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_bytes(b"k1:\xff\xfe\x9fsecret")
    with pytest.raises(ValueError) as raised:
        read_master_keys(None, path)
    assert "STATESTORE_ENCRYPTION_KEYS_FILE" in str(raised.value)
    assert "0xff" not in str(raised.value) and "secret" not in str(raised.value)


def test_settings_refuse_a_malformed_ring_without_showing_it() -> None:
    from pydantic import ValidationError

    from statestore.config import Settings

    key = new_key_text()
    with pytest.raises(ValidationError) as raised:
        Settings(encryption_keys=f"{key}:k1")
    assert "STATESTORE_ENCRYPTION_KEYS" in str(raised.value)
    assert key[:10] not in str(raised.value) and key[-10:] not in str(raised.value)


class _ErasedWhileRead(KeyStore):
    """A key store on which an erasure of the scope finishes while a replica is reading the scope's key."""

    content: SealedContent | None = None
    armed = True

    async def by_scope(self, scope_hash: str) -> StoredKey | None:
        found = await super().by_scope(scope_hash)
        await self._erase_once()
        return found

    async def by_ids(self, ids: Iterable[str]) -> dict[str, StoredKey]:
        found = await super().by_ids(ids)
        await self._erase_once()
        return found

    async def _erase_once(self) -> None:
        if self.armed and self.content is not None:
            self.armed = False
            await self.content.erase(tenant_id="ten_a", user_id=None)


async def test_a_key_read_across_an_erasure_is_not_remembered(engine: AsyncEngine) -> None:
    keys, _ = ring_text("k1")
    first = await sealed(engine, keys).sealer(ALICE)
    assert isinstance(first, ScopeSealer)
    store = _ErasedWhileRead(engine)
    content = SealedContent(store, ring(keys), clock=lambda: 0, remember_seconds=3600, pause=_recorded_pause)
    store.content = content
    # The sealer read the key just before the erasure destroyed it: a new key is read, never the destroyed one.
    again = await content.sealer(ALICE)
    assert isinstance(again, ScopeSealer) and again.key_id != first.key_id
    value = again.seal(b"MARKER", b"row")
    # An open that read the key before an erasure finished is served (it began first), but the key is not kept.
    store.armed = True
    content._by_id.clear()
    assert await content.open(value, b"row", row="r") == b"MARKER"
    with pytest.raises(ContentErased):
        await content.open(value, b"row", row="r")
