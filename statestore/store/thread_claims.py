"""A thread's head claimed in Redis instead of leased in PostgreSQL: the continue by response id that finds its thread
in the cache takes no database round trip before the backend call.

One pipeline does what the lease's UPDATE and the cache read did side by side: SET the claim (NX, PX the lease), and
MGET the thread's cached history, its count, the thread's row as the last commit left it (PostgreSQL's commit returns
it), and the claim's holder. The claim is the turn's when the holder is its token (a pipeline sent again after a lost
connection finds its own claim). The row is served only when it is the row of the cached history's head: written by
the commit that moved the head to the count the history holds, for the head the request names, of the owner asking,
not expired. Any other state (no row, a row another release's commit left behind, a history some path dropped) is a
miss, and the turn takes the PostgreSQL lease as before, keeping the claim.

PostgreSQL stays the guard. A claimed turn commits with a compare-and-set on the head it was sent with, refused while
a PostgreSQL lease is live (a turn of a replica that leases, or a fallback), so a claim lost with Redis, or a row
older than the database, costs a turn its commit, never a fork of the thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from statestore.records import record
from statestore.store.cache_entry import CachedHistory
from statestore.store.redis_rows import decode_fields, encode_fields
from statestore.store.resp import RedisClient, Script
from statestore.store.resp_reader import RespError
from statestore.store.turn_records import HeadAfter, LeasedThread

# KEYS: claim. ARGV: token, lease ms. Renews only the holder's claim.
_RENEW = Script(
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0"
)
# KEYS: claim. ARGV: token. Frees only the holder's claim: one that ran out and was taken stays its new holder's.
_RELEASE = Script("if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0")

# What a claim's call may raise: an error reply, a connection lost or timed out (OSErrors), or uvloop's RuntimeError
# for a write on a transport a reset just closed.
CLAIM_FAULTS = (RespError, OSError, RuntimeError)

# The fields of a thread's row, in their stored order (store/redis_rows.py).
_ROW_WIDTH = 20


def claim_name(head: str, owner: str) -> str:
    """What names a claim under its thread's entry: the head and the owner asking. A request that names another
    owner's head (refused: neither the row nor the database's lease is its) holds a claim of its own, never, even for
    an instant, the one the owner's turn needs."""
    return f"{head}:{owner}"


@record
class Claim:
    """What the claim's pipeline found: whether the turn holds the claim, the history cached, and the thread's row
    when it is served (the row of that history's head)."""

    held: bool
    row: LeasedThread | None
    cached: CachedHistory | None


def encode_row(leased: LeasedThread, after: HeadAfter, head_message_id: str) -> bytes | None:
    """The row a commit left, as kept beside the cached history; None when it cannot be kept (bytes that are not
    text)."""
    try:
        system = leased.system.decode() if leased.system is not None else None
        tools = leased.tools.decode() if leased.tools is not None else None
    except UnicodeDecodeError:
        return None
    return encode_fields(
        [
            head_message_id,
            after.expires_ms,
            leased.id,
            leased.owner,
            leased.tenant_id,
            after.metadata_user_id,
            leased.session_id,
            system,
            tools,
            leased.system_fp,
            leased.tools_fp,
            leased.output_config_fp,
            leased.fixed_markers,
            after.head_position,
            after.byte_count,
            after.ttl_seconds,
            after.base_position,
            after.base_bytes,
            after.head_bytes,
            after.context_tokens,
        ]
    )


def decode_row(raw: bytes) -> tuple[str, int, LeasedThread] | None:
    """(head message id, expiry, the row) of a stored row; None for a row this code cannot read."""
    fields = decode_fields(raw, _ROW_WIDTH)
    if fields is None:
        return None
    try:
        (
            head_message_id,
            expires_ms,
            thread_id,
            owner,
            tenant_id,
            metadata_user_id,
            session_id,
            system,
            tools,
            system_fp,
            tools_fp,
            output_config_fp,
            fixed_markers,
            head_position,
            byte_count,
            ttl_seconds,
            base_position,
            base_bytes,
            head_bytes,
            context_tokens,
        ) = fields
        leased = LeasedThread(
            id=thread_id,
            session_id=session_id,
            system=system.encode() if system is not None else None,
            tools=tools.encode() if tools is not None else None,
            system_fp=system_fp,
            tools_fp=tools_fp,
            output_config_fp=output_config_fp,
            fixed_markers=fixed_markers,
            head_position=head_position,
            byte_count=byte_count,
            ttl_seconds=ttl_seconds,
            base_position=base_position,
            base_bytes=base_bytes,
            head_bytes=head_bytes,
            context_tokens=context_tokens,
            owner=owner,
            tenant_id=tenant_id,
            metadata_user_id=metadata_user_id,
        )
    except (ValueError, TypeError, AttributeError):
        return None
    return head_message_id, expires_ms, leased


class HeadClaims(Protocol):
    """What a turn asks of claims (ThreadClaims; the traced wrapper, statestore/traced.py)."""

    async def claim(
        self, thread_id: str, *, owner: str, response_id: str, token: str, lease_ms: int, now_ms: int
    ) -> Claim: ...

    async def renew(self, thread_id: str, name: str, token: str, lease_ms: int) -> bool: ...

    async def release(self, thread_id: str, name: str, token: str) -> None: ...


class ThreadClaims(HeadClaims):
    """Claims and rows under each thread's cache entry (one hash tag: one Cluster slot). A claim is on one head, for one
    owner (`<entry>:c:<response id>:<owner>`, claim_name): a commit moves the head on, so a claim its commit could not
    free (Redis away at that moment) never stands in the next turn's way, and runs out; and a request naming another
    owner's head never holds the owner's. `keys(thread, name)`: the entry's history, count, row and claim keys. Every
    method raises the client's faults (CLAIM_FAULTS); the caller falls back to the database's lease, or lets a claim run
    out."""

    def __init__(
        self,
        client: RedisClient,
        keys: Callable[[str, str], tuple[str, str, str, str]],
        decode: Callable[[bytes, bytes], CachedHistory | None],
    ) -> None:
        self._client = client
        self._keys = keys
        self._decode = decode

    async def claim(
        self, thread_id: str, *, owner: str, response_id: str, token: str, lease_ms: int, now_ms: int
    ) -> Claim:
        history, count, row, claim = self._keys(thread_id, claim_name(response_id, owner))
        claimed, found = await self._client.pipeline(
            [("SET", claim, token, "NX", "PX", lease_ms), ("MGET", history, count, row, claim)]
        )
        for reply in (claimed, found):
            if isinstance(reply, RespError):  # out of memory, a wrong type: not a claim another turn holds
                raise reply
        joined, counted, stored, holder = found
        held = holder == token.encode()
        cached: CachedHistory | None = (
            self._decode(counted, joined) if isinstance(joined, bytes) and isinstance(counted, bytes) else None
        )
        if not held or cached is None or not isinstance(stored, bytes):
            return Claim(held=held, row=None, cached=cached)
        decoded = decode_row(stored)
        if decoded is None:
            return Claim(held=held, row=None, cached=cached)
        head_message_id, expires_ms, leased = decoded
        if (
            head_message_id != response_id
            or leased.owner != owner
            or leased.id != thread_id
            or expires_ms <= now_ms + lease_ms  # a turn this near the end leases: purges skip leased threads
            or leased.head_position != cached.count
            or cached.version is not None
        ):
            return Claim(held=held, row=None, cached=cached)
        return Claim(held=held, row=leased, cached=cached)

    async def renew(self, thread_id: str, name: str, token: str, lease_ms: int) -> bool:
        """Extend the claim `name` (claim_name) while this turn holds it; False when it ran out (another turn may hold
        it now)."""
        return bool(await _RENEW.run(self._client, (self._keys(thread_id, name)[3],), (token, lease_ms)) == 1)

    async def release(self, thread_id: str, name: str, token: str) -> None:
        await _RELEASE.run(self._client, (self._keys(thread_id, name)[3],), (token,))


@record
class Settle:
    """What a commit leaves beside the history it writes to the cache, in the same script: the row it returned (None:
    none to keep; a thread's, or a chain head's: store/response_heads.py) and the claim it frees (`claimed_head`, the
    claim's name, and `token`, or None; a response's commit frees none)."""

    row: bytes | None
    claimed_head: str | None
    token: str | None
