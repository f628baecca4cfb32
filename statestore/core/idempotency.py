"""Retries that never store twice: a write sent with an `Idempotency-Key` header is done once per key and owner, and
a retry gets the first outcome (docs/responses.md and docs/protocol.md §11). Both doors call this; they only say which
ids their write will store and how to find them stored.

How a keyed write goes:
1. Claim the key: a row with the request's fingerprint (a hash of its route, body and the headers that shape the
   outcome) and the ids the write is to store (`intended`: the response id, the item ids), written BEFORE the write's
   commit. The claim runs out after a while and is renewed while the write runs, so a stopped replica frees it.
2. The write runs under the intended ids. Ended well (2xx), its outcome is kept under the key for the owner's
   `idempotency_ttl_seconds`. Refused (4xx: nothing was stored), the key is forgotten, free for any request. Failed
   otherwise (a backend or database error, a stream cut short), the claim ends and the intended ids stay.
3. A request finding the key taken: another body → IdempotencyKeyReused (422); the outcome kept → that outcome;
   no outcome but intended ids → the door looks them up, and a write found stored is answered (and kept) from what
   is stored, so a commit whose acknowledgement was lost is never made again; still claimed → IdempotencyKeyInFlight
   (409, retry after a second); else the write is run again under the same intended ids (the stored id is unique, so
   even a write that outlived its claim cannot be stored twice).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import orjson

from statestore.clock import Clock
from statestore.core.lease_keeper import LeaseKeeper
from statestore.errors import IdempotencyKeyInFlight, IdempotencyKeyReused, InvalidIdempotencyKey
from statestore.store.idempotency_store import Held, IdempotencyStore, KeyedRequest, Outcome

__all__ = [
    "KEY_HEADER",
    "MAX_KEY_LENGTH",
    "Claim",
    "Held",
    "Idempotency",
    "KeyedRequest",
    "Outcome",
    "Recover",
    "fingerprint",
    "read_key",
    "user_of",
]

KEY_HEADER = b"idempotency-key"
MAX_KEY_LENGTH = 255
# A request's outcome while the first is looked up and run again is a race between replicas: a few rounds settle it.
_ROUNDS = 4

Recover = Callable[[str], Awaitable[Outcome | None]]
# How long an owner's outcomes are kept: its policy's idempotency_ttl_seconds (by tenant id).
TtlFor = Callable[[str | None], Awaitable[int]]


def read_key(raw: bytes) -> str:
    """The header's value as a key: 1 to 255 printable ASCII characters (a UUID, say)."""
    if not 1 <= len(raw) <= MAX_KEY_LENGTH or not all(0x21 <= byte <= 0x7E for byte in raw):
        raise InvalidIdempotencyKey(
            f"Idempotency-Key must be 1 to {MAX_KEY_LENGTH} printable ASCII characters without spaces."
        )
    return raw.decode("ascii")


def fingerprint(route: str, body: bytes, *shaping: bytes | None) -> str:
    """A hash of what was asked: the route, the body (as canonical JSON when it is JSON, so a client's retry that
    orders its keys another way is the same request) and the headers that shape the outcome."""
    try:
        canonical = orjson.dumps(orjson.loads(body), option=orjson.OPT_SORT_KEYS) if body else b""
    except orjson.JSONDecodeError:
        canonical = body
    digest = hashlib.sha256(route.encode())
    for part in (canonical, *shaping):
        digest.update(b"\x00" + (b"\x01" + part if part is not None else b""))
    return digest.hexdigest()


def user_of(body: bytes) -> str | None:
    """The request's `metadata.user_id`, whose erasure erases the key too."""
    try:
        value = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        return None
    metadata = value.get("metadata") if isinstance(value, dict) else None
    user = metadata.get("user_id") if isinstance(metadata, dict) else None
    return user if isinstance(user, str) and len(user) <= 512 else None


@dataclass(slots=True)
class Claim:
    """A write's hold on its key: the ids it is to store, renewed while it runs."""

    request: KeyedRequest
    token: str
    intended: str
    keeper: LeaseKeeper


class Idempotency:
    def __init__(self, store: IdempotencyStore, *, clock: Clock, claim_seconds: int, ttl_for: TtlFor) -> None:
        """`claim_seconds`: how long a claim outlives a replica that stopped renewing it (the turns' lease time)."""
        self.store = store
        self.clock = clock
        self.claim_ms = claim_seconds * 1000
        self.ttl_for = ttl_for

    async def begin(self, request: KeyedRequest, *, intended: str, recover: Recover) -> Claim | Outcome:
        """Claim the key for a write that is to store `intended`, or the outcome a retry gets. Raises
        IdempotencyKeyReused or IdempotencyKeyInFlight."""
        ttl_seconds = await self.ttl_for(request.tenant_id)
        for _ in range(_ROUNDS):
            token = secrets.token_hex(16)
            now = self.clock()
            held = await self.store.claim(
                request,
                token=token,
                intended=intended,
                now_ms=now,
                until_ms=now + self.claim_ms,
                expires_ms=now + ttl_seconds * 1000,
            )
            if held is None:
                return self._claimed(request, token, intended)
            found = await self._answer(request, held, recover)
            if found is not None:
                return found
            if await self.store.take_over(request, token=token, now_ms=now, until_ms=now + self.claim_ms):
                return self._claimed(request, token, held.intended or intended)
        raise IdempotencyKeyInFlight(f"A request with Idempotency-Key '{request.key}' is still being processed.")

    async def _answer(self, request: KeyedRequest, held: Held, recover: Recover) -> Outcome | None:
        """The outcome a request finding the key taken gets; None when it is to run the write again."""
        if held.fingerprint != request.fingerprint:
            raise IdempotencyKeyReused(
                f"Idempotency-Key '{request.key}' was used with another request; use a new key for a new request."
            )
        if held.outcome is not None:
            return held.outcome
        if held.intended is not None:
            stored = await recover(held.intended)
            if stored is not None:
                await self.store.keep(request, stored, token=None)
                return stored
        if held.claimed:
            raise IdempotencyKeyInFlight(f"A request with Idempotency-Key '{request.key}' is still being processed.")
        return None

    def _claimed(self, request: KeyedRequest, token: str, intended: str) -> Claim:
        keeper = LeaseKeeper(
            lambda: self.store.renew(request.owner, request.key, token, until_ms=self.clock() + self.claim_ms),
            interval=self.claim_ms / 3000,
            thread_id="idempotency-key",  # the key is the client's: never logged
        )
        keeper.start()
        return Claim(request, token, intended, keeper)

    async def intend(self, claim: Claim, intended: str, *, user_id: str | None) -> None:
        """The claimed write will store `intended` instead, for `user_id` (what it learnt only once it began, before
        its commit), so a retry looks for those ids and an erasure of that user erases the key (its outcome sealed
        under the user's scope). Raises IdempotencyKeyInFlight when the claim ran out and another request took it."""
        request = claim.request
        if not await self.store.intend(request.owner, request.key, claim.token, intended, user_id=user_id):
            raise IdempotencyKeyInFlight(f"A request with Idempotency-Key '{request.key}' is still being processed.")
        claim.intended = intended
        claim.request = replace(request, user_id=user_id)

    async def succeed(self, claim: Claim, outcome: Outcome) -> None:
        claim.keeper.stop()
        await self.store.keep(claim.request, outcome, token=claim.token)

    async def fail(self, claim: Claim, *, stored_nothing: bool) -> None:
        claim.keeper.stop()
        await self.store.free(claim.request.owner, claim.request.key, claim.token, forget=stored_nothing)
