"""Who owns a thread. In passthrough mode the owner is a keyed hash of the client's own backend credential, so a
thread is visible only to the credential that made it (PROTOCOL §8)."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from statestore.errors import AuthenticationFailed


def credential_of(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    bearer: bytes | None = None
    for name, value in headers:
        if name == b"x-api-key" and value:
            return value
        if name == b"authorization" and value[:7].lower() == b"bearer " and value[7:].strip():
            bearer = value[7:].strip()
    return bearer


class PassthroughOwners:
    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def owner_of(self, headers: Iterable[tuple[bytes, bytes]]) -> str:
        credential = credential_of(headers)
        if credential is None:
            raise AuthenticationFailed("threaded requests need an x-api-key or Authorization: Bearer credential")
        return "p:" + hmac.new(self._secret, credential, hashlib.sha256).hexdigest()[:48]
