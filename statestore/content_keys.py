"""What the stores seal and open content through (encryption at rest, docs/encryption.md): an erasure
scope, the associated data that names a row, and the keys' interface. The implementations are in
statestore/encryption/: a pass-through when encryption is off, AES-256-GCM under a data key per scope when it is on.

A sealed value begins with MAGIC; a value without it was stored in clear (before encryption was turned on)."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

MAGIC = b"\x00ss\x01"  # no stored JSON or SSE value begins with a NUL byte


def is_sealed(value: bytes | memoryview) -> bool:
    return value[: len(MAGIC)] == MAGIC


@dataclass(frozen=True, slots=True)
class Scope:
    """An erasure scope: what the erasure API can name (the owner or its tenant, and `metadata.user_id` if given)."""

    owner: str
    tenant_id: str | None
    user_id: str | None

    @property
    def hash(self) -> str:
        return _scope_hash(self.owner, self.user_id)


@functools.lru_cache(maxsize=4096)  # asked on every turn, for the few scopes a replica serves at a time
def _scope_hash(owner: str, user_id: str | None) -> str:
    user = b"\x01" + user_id.encode() if user_id is not None else b"\x00"
    return hashlib.sha256(owner.encode() + b"\x00" + user).hexdigest()


def row_data(*parts: str | int) -> bytes:
    """Associated data naming a row: table tag, owner, id, position…, each part unambiguous."""
    return "\x1f".join(map(str, parts)).encode()


class ContentSealer(Protocol):
    def seal(self, plaintext: bytes, associated: bytes) -> bytes: ...


class _ClearSealer:
    __slots__ = ()

    def seal(self, plaintext: bytes, associated: bytes) -> bytes:
        return plaintext


CLEAR = _ClearSealer()


class ContentKeys(Protocol):
    """What the stores seal and open through. `enabled` is False when encryption is off: callers skip sealing."""

    @property
    def enabled(self) -> bool: ...

    async def sealer(self, scope: Scope) -> ContentSealer: ...

    async def open(self, value: bytes, associated: bytes, *, row: str) -> bytes:
        """The plaintext of `value`; ContentErased when its key was destroyed, UnopenableContent when it does not
        open. `row` names the row in the log (ids only)."""
        ...

    async def open_many(
        self, values: Sequence[bytes | memoryview], associated: Sequence[bytes], *, row: str
    ) -> list[bytes]: ...

    async def erase(self, *, tenant_id: str | None, user_id: str | None, resumed: bool = False) -> int:
        """Destroy the data keys of the scopes an erasure names; how many. `resumed`: the erasure is taken up after
        its process stopped, which may have destroyed the keys moments before: what replicas remember of them is
        waited out all the same."""
        ...

    async def start_problem(self) -> str | None:
        """Why the server must not start with these keys, or None."""
        ...
