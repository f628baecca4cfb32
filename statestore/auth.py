"""Who is calling (docs/protocol.md §8).

- passthrough mode: the client's own backend credential is forwarded, and the owner of its threads is a keyed hash
  of that credential, so a thread is visible only to the credential that made it;
- keys mode: the client presents a statestore API key (stored hashed); the owner is its tenant, and the backend
  credential comes from configuration;
- admin tokens guard `/admin/v1` and are never a tenant credential.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from statestore.errors import AuthenticationFailed, PermissionDenied
from statestore.store.admin_repository import AdminRepository

KEY_PREFIX = "ssk_"


@dataclass(frozen=True, slots=True)
class Principal:
    owner: str
    tenant_id: str | None
    # keys mode: the credential header to send to the backend in place of the client's.
    upstream_credential: tuple[bytes, bytes] | None


def credential_of(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    bearer: bytes | None = None
    for name, value in headers:
        if name == b"x-api-key" and value:
            return value
        if name == b"authorization" and value[:7].lower() == b"bearer " and value[7:].strip():
            bearer = value[7:].strip()
    return bearer


def hash_key(secret: str) -> str:
    # Keys are 190+ random bits, so a plain hash is enough: there is nothing to brute-force.
    return hashlib.sha256(secret.encode()).hexdigest()


def new_api_key() -> tuple[str, str]:
    """A new statestore API key: (the secret, shown once; its display prefix)."""
    secret = KEY_PREFIX + secrets.token_urlsafe(32)
    return secret, secret[: len(KEY_PREFIX) + 6]


class Authenticator(Protocol):
    async def authenticate(self, headers: Iterable[tuple[bytes, bytes]]) -> Principal: ...

    def forget(self) -> None: ...


class PassthroughAuthenticator:
    # The principals of the credentials seen lately: an HMAC costs more than the rest of authentication, and a
    # client sends the same credential on every turn. Bounded; cleared when full.
    _REMEMBERED = 4_096

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._principals: dict[bytes, Principal] = {}

    async def authenticate(self, headers: Iterable[tuple[bytes, bytes]]) -> Principal:
        credential = credential_of(headers)
        if credential is None:
            raise AuthenticationFailed("an x-api-key or Authorization: Bearer credential is required")
        principal = self._principals.get(credential)
        if principal is None:
            owner = "p:" + hmac.new(self._secret, credential, hashlib.sha256).hexdigest()[:48]
            principal = Principal(owner=owner, tenant_id=None, upstream_credential=None)
            if len(self._principals) >= self._REMEMBERED:
                self._principals.clear()
            self._principals[credential] = principal
        return principal

    def forget(self) -> None:
        return None


class KeysAuthenticator:
    """Looks keys up by hash, remembering answers for a few seconds; `forget()` drops them at once after a revocation
    through this process (other processes see it within `cache_seconds`)."""

    def __init__(
        self,
        admin: AdminRepository,
        *,
        upstream_key: str | None,
        tenant_upstream_keys: Mapping[str, str],
        cache_seconds: float,
    ) -> None:
        self._admin = admin
        self._upstream_key = upstream_key
        self._tenant_keys = dict(tenant_upstream_keys)
        self._cache_seconds = cache_seconds
        self._cache: dict[str, tuple[float, Principal | None]] = {}

    async def authenticate(self, headers: Iterable[tuple[bytes, bytes]]) -> Principal:
        credential = credential_of(headers)
        if credential is None:
            raise AuthenticationFailed("a statestore API key is required (x-api-key or Authorization: Bearer)")
        digest = hash_key(credential.decode("latin-1"))
        now = time.monotonic()
        cached = self._cache.get(digest)
        if cached is not None and cached[0] > now:
            principal = cached[1]
        else:
            principal = await self._lookup(digest)
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[digest] = (now + self._cache_seconds, principal)
        if principal is None:
            raise AuthenticationFailed("invalid or revoked API key")
        if principal.upstream_credential is None:
            # Without a backend credential of its own the request would go out with the client's statestore key.
            raise PermissionDenied(
                "no backend credential is configured for this tenant (STATESTORE_TENANT_UPSTREAM_KEYS or "
                "STATESTORE_UPSTREAM_API_KEY)"
            )
        return principal

    async def _lookup(self, digest: str) -> Principal | None:
        found = await self._admin.owner_of_key(digest)
        if found is None:
            return None
        backend_key = self._tenant_keys.get(found.tenant_name, self._upstream_key)
        credential = (b"x-api-key", backend_key.encode()) if backend_key else None
        return Principal(owner="t:" + found.tenant_id, tenant_id=found.tenant_id, upstream_credential=credential)

    def forget(self) -> None:
        self._cache.clear()


class AdminTokens:
    def __init__(self, table: Mapping[str, str]) -> None:
        # Compared by digest so every comparison takes the same time whatever the token's length.
        self._digests = [(hashlib.sha256(token.encode()).digest(), name) for token, name in table.items()]

    @property
    def configured(self) -> bool:
        return bool(self._digests)

    def actor(self, headers: Iterable[tuple[bytes, bytes]]) -> str | None:
        """The name of the admin token presented as `Authorization: Bearer`, or None."""
        presented = None
        for header, value in headers:
            if header == b"authorization" and value[:7].lower() == b"bearer ":
                presented = hashlib.sha256(value[7:].strip()).digest()
        if presented is None:
            return None
        found = None
        for digest, actor in self._digests:
            if hmac.compare_digest(digest, presented):
                found = actor
        return found

    def identify(self, token: str) -> tuple[str, bytes] | None:
        """The name and digest of the admin token `token`, or None: the console's sign-in."""
        presented = hashlib.sha256(token.strip().encode()).digest()
        found = None
        for digest, actor in self._digests:
            if hmac.compare_digest(digest, presented):
                found = (actor, digest)
        return found

    def digests_named(self, name: str) -> list[bytes]:
        """The digests of the configured tokens called `name`: the keys that sign that token's console sessions, so
        a session ends when its token is removed from the configuration."""
        return [digest for digest, actor in self._digests if actor == name]
