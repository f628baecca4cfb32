"""The master keys that wrap data keys. A data key is stored only wrapped; whoever holds the wrapped keys without the
master keys holds nothing usable.

`KeyWrapper` is the seam for a key service: a KMS or Vault Transit takes the ring's place by wrapping and unwrapping
through its API (docs/encryption.md shows how). The ring here reads its keys from the environment or a file:
`id:key,id:key`, newest first; the newest wraps, every one unwraps, so a master key rotates with no downtime."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from statestore.sealing import NONCE_BYTES, SealingKey, parse_keys


class MissingMasterKey(LookupError):
    """A data key is wrapped under a master key this process was not given."""

    def __init__(self, master_id: str) -> None:
        super().__init__(master_id)
        self.master_id = master_id


class KeyWrapper(Protocol):
    """Wraps and unwraps data keys. `associated` binds a wrapped key to its row (its id and scope)."""

    @property
    def newest_id(self) -> str: ...

    def knows(self, master_id: str) -> bool: ...

    def wrap(self, data_key: bytes, associated: bytes) -> tuple[str, bytes]:
        """(the id of the master key used, the wrapped key)."""
        ...

    def unwrap(self, master_id: str, wrapped: bytes, associated: bytes) -> bytes:
        """The data key; MissingMasterKey when `master_id` is not here, ValueError when the wrapped key is damaged."""
        ...


class MasterKeyRing:
    """AES-256-GCM key wrapping under keys given to the process."""

    __slots__ = ("_ciphers", "_newest")

    def __init__(self, keys: list[SealingKey]) -> None:
        if not keys:
            raise ValueError("a master key ring needs at least one key")
        self._newest = keys[0].key_id
        self._ciphers = {k.key_id: AESGCM(k.key) for k in keys}

    @property
    def newest_id(self) -> str:
        return self._newest

    @property
    def ids(self) -> list[str]:
        return list(self._ciphers)

    def knows(self, master_id: str) -> bool:
        return master_id in self._ciphers

    def wrap(self, data_key: bytes, associated: bytes) -> tuple[str, bytes]:
        nonce = secrets.token_bytes(NONCE_BYTES)
        return self._newest, nonce + self._ciphers[self._newest].encrypt(nonce, data_key, associated)

    def unwrap(self, master_id: str, wrapped: bytes, associated: bytes) -> bytes:
        cipher = self._ciphers.get(master_id)
        if cipher is None:
            raise MissingMasterKey(master_id)
        try:
            return cipher.decrypt(wrapped[:NONCE_BYTES], wrapped[NONCE_BYTES:], associated)
        except InvalidTag:
            raise ValueError("the wrapped data key does not open under its master key") from None


def read_master_keys(inline: str | None, file: Path | None) -> MasterKeyRing | None:
    """The ring from STATESTORE_ENCRYPTION_KEYS, or from the file STATESTORE_ENCRYPTION_KEYS_FILE names (same format;
    a file lets a secret manager mount the keys); None when neither is set (encryption off). A ValueError says what
    is wrong with the setting and never contains a key."""
    if inline and file:
        raise ValueError("set STATESTORE_ENCRYPTION_KEYS or STATESTORE_ENCRYPTION_KEYS_FILE, not both")
    if file is not None:
        try:
            inline = file.read_text()
        except OSError as exc:
            raise ValueError(f"STATESTORE_ENCRYPTION_KEYS_FILE: cannot read {file}: {exc.strerror}") from None
        except UnicodeDecodeError:
            # Its own message quotes the offending byte, a byte of the file.
            raise ValueError(f"STATESTORE_ENCRYPTION_KEYS_FILE: {file} is not UTF-8 text") from None
    if not inline or not inline.strip():
        return None
    try:
        return MasterKeyRing(parse_keys(inline.replace("\n", ",")))
    except ValueError as exc:
        raise ValueError(f"STATESTORE_ENCRYPTION_KEYS: {exc}") from None
