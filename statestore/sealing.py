"""Sealed values: a plaintext made opaque and unforgeable for a client to hold and send back (AES-256-GCM under a key
of the server, bound to associated data the caller names, e.g. the owner). The one place a value is sealed.

A ring of keys rotates: the first seals, every one opens, and the key's id travels in the value, so a key added in
front (and the old one kept behind it) leaves every value already handed out still open. A sealed value reads
`<key id>.<base64url(nonce ‖ ciphertext ‖ tag)>`."""

from __future__ import annotations

import base64
import binascii
import re
import secrets
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

KEY_BYTES = 32  # AES-256
NONCE_BYTES = 12  # GCM's own size: a random nonce per value (2^32 values per key keep collisions negligible)
_KEY_ID = re.compile(r"[A-Za-z0-9_-]{1,16}")


class Unsealable(ValueError):
    """The value was not sealed by this ring for this associated data: tampered with, another's, under a key the ring
    no longer holds, or no sealed value at all. Deliberately says no more than that."""


@dataclass(frozen=True, slots=True)
class SealingKey:
    key_id: str
    key: bytes

    def __post_init__(self) -> None:
        if not _KEY_ID.fullmatch(self.key_id):
            raise ValueError("a key id is 1 to 16 letters, digits, '-' or '_'")
        if len(self.key) != KEY_BYTES:
            raise ValueError(f"a key is {KEY_BYTES} bytes")


def parse_keys(raw: str) -> list[SealingKey]:
    """`id:key,id:key` (each key 32 bytes in URL-safe base64), newest first, as a setting spells a ring. A ValueError
    names the entry by its position and id, never the key."""
    keys: list[SealingKey] = []
    for position, entry in enumerate(filter(None, (part.strip() for part in raw.split(","))), start=1):
        key_id, colon, encoded = entry.partition(":")
        if not colon:
            raise ValueError(f"entry {position}: expected id:key")
        # The id is named only when it is a valid one: an entry written key first ("<key>:k1") must not show the key.
        named = f"entry {position} ({key_id})" if _KEY_ID.fullmatch(key_id) else f"entry {position}"
        try:
            key = _b64decode(encoded.rstrip("="))
        except (binascii.Error, ValueError):
            raise ValueError(f"{named}: the key is not URL-safe base64") from None
        try:
            keys.append(SealingKey(key_id, key))
        except ValueError as exc:
            raise ValueError(f"{named}: {exc}") from None
    if not keys:
        raise ValueError("no keys")
    if len({k.key_id for k in keys}) != len(keys):
        raise ValueError("a key id appears twice")
    return keys


def _b64decode(text: str) -> bytes:
    """Strictly: a character outside the alphabet is refused, not skipped, and so is a last character whose unused
    bits are set, so a value opens only exactly as it was handed out."""
    decoded = base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)
    if base64.urlsafe_b64encode(decoded).decode().rstrip("=") != text:
        raise ValueError("not canonical base64")
    return decoded


def derived_key(secret: str, key_id: str, purpose: bytes) -> SealingKey:
    """A key derived (HKDF-SHA256) from another secret of the server's, for one purpose: stable across restarts and
    replicas without a setting of its own, and never the secret itself."""
    hkdf = HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=purpose)
    return SealingKey(key_id, hkdf.derive(secret.encode()))


def new_key_text() -> str:
    """A fresh key as a ring's entry spells it (for operators: `python -c ...`)."""
    return base64.urlsafe_b64encode(secrets.token_bytes(KEY_BYTES)).decode().rstrip("=")


class Sealer:
    """Seals under the ring's first key, opens under any of them."""

    __slots__ = ("_ciphers", "_newest")

    def __init__(self, keys: list[SealingKey]) -> None:
        if not keys:
            raise ValueError("a sealer needs at least one key")
        self._newest = keys[0].key_id
        self._ciphers = {k.key_id: AESGCM(k.key) for k in keys}

    def seal(self, plaintext: bytes, associated: bytes) -> str:
        nonce = secrets.token_bytes(NONCE_BYTES)
        sealed = nonce + self._ciphers[self._newest].encrypt(nonce, plaintext, associated)
        return self._newest + "." + base64.urlsafe_b64encode(sealed).decode().rstrip("=")

    def open(self, value: str, associated: bytes) -> bytes:
        key_id, dot, encoded = value.partition(".")
        cipher = self._ciphers.get(key_id) if dot else None
        if cipher is None:
            raise Unsealable("unknown key")
        try:
            sealed = _b64decode(encoded)
        except (binascii.Error, ValueError):
            raise Unsealable("not a sealed value") from None
        if len(sealed) < NONCE_BYTES + 16:
            raise Unsealable("not a sealed value")
        try:
            return cipher.decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], associated)
        except InvalidTag:
            raise Unsealable("not sealed here") from None
