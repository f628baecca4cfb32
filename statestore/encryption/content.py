"""Sealed content: every stored content byte under its erasure scope's data key (AES-256-GCM).

A sealed value is `MAGIC ‖ data key id (16 bytes) ‖ nonce (12) ‖ ciphertext ‖ tag`, so a value opens without knowing
its scope first (a cache entry is read while the lease is taken, before the turn knows whose it is). The associated
data a caller names binds the value to its row (table, owner, row id, position): moved to another row or owner, it
does not open. A value without MAGIC was stored before encryption was turned on, and is read as it is.

Data keys are made on a scope's first use, kept wrapped in the key store, and remembered unwrapped for
STATESTORE_DATA_KEY_CACHE_SECONDS; an erasure deletes them (the key store first) and forgets them here at once. Other
replicas forget within that many seconds, and until then may still seal a new value of the erased scope under its
destroyed key; so `erase` returns only once that time (and one commit's, `settle_seconds`) has passed, and the rows the
erasure then deletes include every one sealed meanwhile: nothing is left stored that no key opens."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from statestore.content_keys import CLEAR, MAGIC, ContentSealer, Scope, is_sealed
from statestore.encryption.master_keys import KeyWrapper, MissingMasterKey
from statestore.errors import ContentErased, UnopenableContent
from statestore.sealing import KEY_BYTES, NONCE_BYTES
from statestore.store.keystore import KeyStore, Rewrap, StoredKey

log = logging.getLogger(__name__)

KEY_ID_BYTES = 16
_HEADER = len(MAGIC) + KEY_ID_BYTES + NONCE_BYTES
_TAG_BYTES = 16
# Bounds the remembered keys of a process that serves very many scopes; past it, they are read again as needed.
_MAX_REMEMBERED = 100_000


class ScopeSealer:
    """Seals under one scope's data key."""

    __slots__ = ("_cipher", "_prefix")

    def __init__(self, key_id: bytes, cipher: AESGCM) -> None:
        self._prefix = MAGIC + key_id
        self._cipher = cipher

    @property
    def key_id(self) -> bytes:
        return self._prefix[len(MAGIC) :]

    def seal(self, plaintext: bytes, associated: bytes) -> bytes:
        nonce = secrets.token_bytes(NONCE_BYTES)
        return self._prefix + nonce + self._cipher.encrypt(nonce, plaintext, associated)


def _wrap_data(key_id: str, scope_hash: str) -> bytes:
    return b"statestore data key\x00" + key_id.encode() + b"\x00" + scope_hash.encode()


class ClearContent:
    """Encryption off. A sealed value met anyway (sealed by a replica that has the keys) is refused, never served."""

    def __init__(self, keystore: KeyStore) -> None:
        self._keystore = keystore

    @property
    def enabled(self) -> bool:
        return False

    async def sealer(self, scope: Scope) -> ContentSealer:
        return CLEAR

    async def open(self, value: bytes, associated: bytes, *, row: str) -> bytes:
        if is_sealed(value):
            log.error("a sealed value met without encryption keys", extra={"row": row})
            raise UnopenableContent("stored content is sealed and this server has no encryption keys")
        return value

    async def open_many(
        self, values: Sequence[bytes | memoryview], associated: Sequence[bytes], *, row: str
    ) -> list[bytes]:
        return [await self.open(bytes(value), b"", row=row) for value in values]

    async def erase(self, *, tenant_id: str | None, user_id: str | None, resumed: bool = False) -> int:
        # Keys made while encryption was on still name their scopes: an erasure destroys them all the same.
        return len(await self._keystore.destroy(tenant_id=tenant_id, user_id=user_id))

    async def start_problem(self) -> str | None:
        counts = await self._keystore.count_by_master()
        if not counts:
            return None
        return (
            f"this database holds content sealed under {sum(counts.values())} data keys, wrapped under master key(s) "
            f"{', '.join(sorted(counts))}, and STATESTORE_ENCRYPTION_KEYS is not set: set it (or "
            "STATESTORE_ENCRYPTION_KEYS_FILE) with those keys"
        )


class SealedContent:
    def __init__(
        self,
        keystore: KeyStore,
        master: KeyWrapper,
        *,
        clock: Callable[[], int],
        remember_seconds: float = 10.0,
        settle_seconds: float = 6.0,
        pause: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        """`settle_seconds`: how long a commit may take between sealing its values and their rows becoming visible
        (the database timeout, and a margin)."""
        self._keystore = keystore
        self._settle = settle_seconds
        self._pause = pause
        self._master = master
        self._clock = clock
        self._remember = remember_seconds
        self._by_scope: dict[str, tuple[ScopeSealer, float]] = {}
        self._by_id: dict[bytes, tuple[AESGCM, str, float]] = {}  # key id → (cipher, scope hash, until)
        self._erasures = 0  # erasures finished in this process: a key read across one is not remembered

    @property
    def enabled(self) -> bool:
        return True

    async def sealer(self, scope: Scope) -> ContentSealer:
        scope_hash = scope.hash
        found = self._by_scope.get(scope_hash)
        if found is not None and found[1] > time.monotonic():
            return found[0]
        while True:
            erasures = self._erasures
            stored = await self._keystore.by_scope(scope_hash)
            if stored is None:
                stored = await self._keystore.add(self._new_key(scope, scope_hash), self._clock())
            if erasures == self._erasures:
                break
            # An erasure finished while the key was read: it may be the key it destroyed, read just before, and it
            # must not be remembered (and sealed under) after the erasure forgot it. Read it again.
        cipher = self._remember_key(stored)
        sealer = ScopeSealer(bytes.fromhex(stored.id), cipher)
        self._by_scope[scope_hash] = (sealer, time.monotonic() + self._remember)
        return sealer

    def _new_key(self, scope: Scope, scope_hash: str) -> StoredKey:
        key_id = secrets.token_bytes(KEY_ID_BYTES).hex()
        master_id, wrapped = self._master.wrap(secrets.token_bytes(KEY_BYTES), _wrap_data(key_id, scope_hash))
        return StoredKey(key_id, scope_hash, scope.owner, scope.tenant_id, scope.user_id, master_id, wrapped)

    def _remember_key(self, stored: StoredKey, *, remember: bool = True) -> AESGCM:
        try:
            key = self._master.unwrap(stored.master_id, stored.wrapped, _wrap_data(stored.id, stored.scope_hash))
        except MissingMasterKey as exc:
            log.error("a data key is wrapped under a missing master key", extra={"master_id": exc.master_id})
            raise UnopenableContent(f"master key '{exc.master_id}' is not in STATESTORE_ENCRYPTION_KEYS") from None
        except ValueError:
            log.error("a data key does not unwrap", extra={"data_key": stored.id, "master_id": stored.master_id})
            raise UnopenableContent("a data key does not unwrap under its master key") from None
        if len(self._by_id) >= _MAX_REMEMBERED or len(self._by_scope) >= _MAX_REMEMBERED:
            self._by_id.clear()
            self._by_scope.clear()
        cipher = AESGCM(key)
        if remember:
            self._by_id[bytes.fromhex(stored.id)] = (cipher, stored.scope_hash, time.monotonic() + self._remember)
        return cipher

    async def _ciphers(self, key_ids: set[bytes], row: str) -> dict[bytes, AESGCM]:
        now = time.monotonic()
        found: dict[bytes, AESGCM] = {}
        missing: list[str] = []
        for key_id in key_ids:
            remembered = self._by_id.get(key_id)
            if remembered is not None and remembered[2] > now:
                found[key_id] = remembered[0]
            else:
                missing.append(key_id.hex())
        if missing:
            erasures = self._erasures
            stored = await self._keystore.by_ids(missing)
            # Read before an erasure that finished meanwhile: good for this read, which began first, not to be kept.
            keep = erasures == self._erasures
            for key_id_hex in missing:
                if key_id_hex not in stored:
                    self._by_id.pop(bytes.fromhex(key_id_hex), None)
                    log.info("content of an erased scope asked for", extra={"row": row})
                    raise ContentErased("this conversation was erased")
                found[bytes.fromhex(key_id_hex)] = self._remember_key(stored[key_id_hex], remember=keep)
        return found

    async def open(self, value: bytes, associated: bytes, *, row: str) -> bytes:
        return (await self.open_many([value], [associated], row=row))[0]

    async def open_many(
        self, values: Sequence[bytes | memoryview], associated: Sequence[bytes], *, row: str
    ) -> list[bytes]:
        """Each value opened from a view of it (a long cache entry's frames are not copied before they decrypt)."""
        ciphers = await self._ciphers_of(values, row)
        opened: list[bytes] = []
        for value, data in zip(values, associated, strict=True):
            if not is_sealed(value):
                opened.append(bytes(value))
                continue
            view = memoryview(value)
            cipher = ciphers[bytes(view[len(MAGIC) : len(MAGIC) + KEY_ID_BYTES])]
            try:
                opened.append(cipher.decrypt(view[_HEADER - NONCE_BYTES : _HEADER], view[_HEADER:], data))
            except InvalidTag:
                raise _unopenable(row) from None
        return opened

    async def _ciphers_of(self, values: Sequence[bytes | memoryview], row: str) -> dict[bytes, AESGCM]:
        """The ciphers of the data keys the sealed `values` name."""
        key_ids: set[bytes] = set()
        for value in values:
            if is_sealed(value):
                if len(value) < _HEADER + _TAG_BYTES:
                    # Checked before any key is looked up: a cut key id would otherwise read as an erased scope's.
                    raise _unopenable(row)
                key_ids.add(bytes(value[len(MAGIC) : len(MAGIC) + KEY_ID_BYTES]))
        return await self._ciphers(key_ids, row) if key_ids else {}

    async def erase(self, *, tenant_id: str | None, user_id: str | None, resumed: bool = False) -> int:
        destroyed = {bytes.fromhex(i) for i in await self._keystore.destroy(tenant_id=tenant_id, user_id=user_id)}
        if destroyed:
            scopes = {self._by_id[i][1] for i in destroyed if i in self._by_id}
            for key_id in destroyed:
                self._by_id.pop(key_id, None)
            for scope_hash in scopes:
                self._by_scope.pop(scope_hash, None)
            # A scope remembered only as a sealer (its key id not looked up since): forget it by its key id too.
            for scope_hash, (sealer, _) in list(self._by_scope.items()):
                if sealer.key_id in destroyed:
                    del self._by_scope[scope_hash]
        self._erasures += 1
        if destroyed or resumed:
            # Until every replica has forgotten the keys, a turn of the scope may still seal under one; its rows are
            # visible to the deletion that follows only after this wait, so the deletion takes them too.
            await self._pause(self._remember + self._settle)
        return len(destroyed)

    async def start_problem(self) -> str | None:
        counts = await self._keystore.count_by_master()
        missing = sorted(m for m in counts if not self._master.knows(m))
        if missing:
            return (
                "STATESTORE_ENCRYPTION_KEYS lacks master key(s) "
                + ", ".join(f"'{m}' (wraps {counts[m]} data keys)" for m in missing)
                + ": add them back after the newest key (`statestore admin encryption rotate` moves data keys off an "
                "old master key before it is removed)"
            )
        for master_id in counts:
            # One key under each master key must unwrap: a key given under the right id but with the wrong bytes.
            sample = await self._keystore.wrapped_under([master_id], limit=1)
            if sample:
                try:
                    self._master.unwrap(master_id, sample[0].wrapped, _wrap_data(sample[0].id, sample[0].scope_hash))
                except ValueError:
                    return (
                        f"master key '{master_id}' in STATESTORE_ENCRYPTION_KEYS is not the key its data keys were "
                        "wrapped under"
                    )
        return None

    async def rotate(self, *, batch_size: int = 500, progress: Callable[[int], None] | None = None) -> int:
        """Re-wrap every data key not under the newest master key; how many. Online: a batch is one short transaction,
        a key is replaced only if it is still wrapped as it was read (an erasure or another rotation may have got
        there first), and the data key itself never changes, so every sealed value stays as it is. `progress` hears
        the running total after each batch."""
        newest = self._master.newest_id
        moved = 0
        while True:
            counts = await self._keystore.count_by_master()
            older = [m for m in counts if m != newest]
            if not older:
                return moved
            batch = await self._keystore.wrapped_under(older, limit=batch_size)
            if not batch:
                return moved
            rewrapped = []
            for stored in batch:
                data = _wrap_data(stored.id, stored.scope_hash)
                key = self._master.unwrap(stored.master_id, stored.wrapped, data)
                master_id, wrapped = self._master.wrap(key, data)
                rewrapped.append(Rewrap(stored.id, stored.master_id, master_id, wrapped))
            moved += await self._keystore.rewrap(rewrapped)
            if progress is not None:
                progress(moved)


def _unopenable(row: str) -> UnopenableContent:
    log.error("a stored value does not open under its data key", extra={"row": row})
    return UnopenableContent("stored content does not open")
