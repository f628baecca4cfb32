"""The history cache in Redis (HistoryCache, store/cache.py): each entry is two keys, its count and its joined
messages, written by the scripts of store/cache_scripts.py so the two never disagree."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from statestore.content_keys import ContentSealer
from statestore.store.cache import append_tail
from statestore.store.cache_entry import CachedHistory, CacheKey, decode_count, encode_count, thread_key
from statestore.store.cache_scripts import APPEND, APPEND_SETTLE, MOVE, PUT, PUT_SETTLE
from statestore.store.redis_commands import RedisCommands
from statestore.store.resp import RedisClient
from statestore.store.resp_cluster import ClusterClient
from statestore.store.resp_reader import RespError
from statestore.store.response_heads import ResponseHeads
from statestore.store.thread_claims import Settle, ThreadClaims

logger = logging.getLogger(__name__)


def _settled(then: Settle) -> tuple[bytes, str]:
    """A Settle as the settling scripts' last two arguments ('' for none)."""
    return then.row or b"", then.token if then.claimed_head is not None and then.token is not None else ""


def _entry(count: bytes, joined: bytes) -> CachedHistory | None:
    """An entry as its two keys hold it; None for a count this code cannot read."""
    decoded = decode_count(count)
    if decoded is None:
        return None
    n, version = decoded
    # The two keys can disagree only through outside interference; do not serve that.
    if n < 0 or (n == 0) != (joined == b""):
        return None
    return CachedHistory(n, joined, version)


# Errors a cache call may raise; all of them mean "behave like a miss". OSError covers the client's
# RedisConnectionError and RedisTimeout. RuntimeError is what uvloop raises for a write on a transport that a reset
# just closed, before the client notices it is gone.
_FAULTS = (RespError, OSError, RuntimeError)

_DELETE_BATCH = 256  # threads per pipeline in delete_many: bounded request size, few round trips
_WARN_INTERVAL_S = 10.0


class _WarningGate:
    """Lets one warning through per interval, so an outage logs a line every few seconds, not per request."""

    def __init__(self, interval_s: float = _WARN_INTERVAL_S) -> None:
        self._interval_s = interval_s
        self._next_at = 0.0
        self._suppressed = 0

    def open(self) -> int | None:
        """Return how many warnings were suppressed since the last one, or None to stay quiet."""
        now = time.monotonic()
        if now < self._next_at:
            self._suppressed += 1
            return None
        self._next_at = now + self._interval_s
        suppressed, self._suppressed = self._suppressed, 0
        return suppressed


class RedisHistoryCache:
    """History cache in Redis (standalone, or Cluster with `?cluster=1` in the URL).

    Per thread two keys under one hash tag, so Cluster keeps them in one slot and the scripts and MGET
    stay single-slot: `<prefix>{<key name>}:h` (the joined bytes, APPEND-able) and `...:n` (the count).
    No command ever spans two threads.
    """

    def __init__(self, client: RedisClient, prefix: str) -> None:
        """On the process's one client (statestore/resources.py builds it, and closes it), whose own timeout is the
        cache's: each command waits at most that long, and a failure is a miss."""
        if "{" in prefix or "}" in prefix:
            # A brace in the prefix would become the hash tag and put every thread in one slot.
            raise ValueError("the redis key prefix must not contain '{' or '}'")
        self._prefix = prefix
        self._cluster = isinstance(client, ClusterClient)
        self._commands = RedisCommands(client)
        self._gate = _WarningGate()
        self.errors = 0

    @property
    def kind(self) -> str:
        return "redis"

    def _keys(self, key: CacheKey) -> tuple[str, str]:
        tagged = f"{self._prefix}{{{key.name}}}"
        return f"{tagged}:h", f"{tagged}:n"

    def _dropped(self, key: CacheKey) -> tuple[str, str, str]:
        """An entry's keys and the row a thread's commit keeps beside it (store/thread_claims.py): a thread's
        system and tools go with its history."""
        tagged = f"{self._prefix}{{{key.name}}}"
        return f"{tagged}:h", f"{tagged}:n", f"{tagged}:r"

    def _settle_keys(self, key: CacheKey, head: str) -> tuple[str, str, str, str]:
        """An entry's history and count, the row beside it, and the claim on `head` (a thread's)."""
        tagged = f"{self._prefix}{{{key.name}}}"
        return f"{tagged}:h", f"{tagged}:n", f"{tagged}:r", f"{tagged}:c:{head}"

    def _claim_keys(self, thread_id: str, head: str) -> tuple[str, str, str, str]:
        return self._settle_keys(thread_key(thread_id), head)

    def thread_claims(self) -> ThreadClaims:
        """Claims on thread heads under this cache's entries (a claim's keys share its thread's hash tag: one slot on a
        Redis Cluster)."""
        return ThreadClaims(self._commands.client, self._claim_keys, _entry)

    def response_heads(self) -> ResponseHeads:
        """Chain heads' rows under this cache's entries (store/response_heads.py)."""
        return ResponseHeads(self._commands.client, self._dropped, _entry)

    def _fault(self, operation: str, key: CacheKey | None, exc: BaseException) -> None:
        self.errors += 1
        suppressed = self._gate.open()
        if suppressed is not None:
            # The exception type and text only: Redis error replies never echo stored values.
            logger.warning(
                "history cache %s failed for %s, served as a miss: %s: %s (%d similar suppressed)",
                operation,
                key.name if key is not None else "-",
                type(exc).__name__,
                str(exc)[:200],
                suppressed,
            )

    async def get_raw(self, key: CacheKey) -> tuple[bytes, bytes] | None:
        try:
            joined, count = await self._commands.mget(self._keys(key))
        except _FAULTS as exc:
            self._fault("get", key, exc)
            return None
        if not isinstance(joined, bytes) or not isinstance(count, bytes):
            return None
        return count, joined

    async def get(self, key: CacheKey) -> CachedHistory | None:
        found = await self.get_raw(key)
        if found is None:
            return None
        count, joined = found
        return _entry(count, joined)

    async def put(
        self, key: CacheKey, history: CachedHistory, ttl_ms: int, *, sealer: ContentSealer, then: Settle | None = None
    ) -> None:
        count = encode_count(history.count, history.version)
        if then is None or ttl_ms <= 0:
            await self.put_raw(key, count, history.joined, ttl_ms)
            return
        keys = self._settle_keys(key, then.claimed_head or "")
        try:
            await self._commands.run(PUT_SETTLE, keys, (history.joined, count, ttl_ms, *_settled(then)))
        except _FAULTS as exc:
            self._fault("put", key, exc)

    async def put_raw(self, key: CacheKey, count: bytes, data: bytes, ttl_ms: int) -> None:
        if ttl_ms <= 0:
            await self.delete(key)
            return
        try:
            await self._commands.run(PUT, self._keys(key), (data, count, ttl_ms))
        except _FAULTS as exc:
            self._fault("put", key, exc)

    async def append(
        self,
        key: CacheKey,
        expected_count: int,
        added: list[bytes],
        ttl_ms: int,
        *,
        sealer: ContentSealer,
        new_count: int | None = None,
        then: Settle | None = None,
    ) -> None:
        # The script appends only when the entry holds `expected_count` messages, so the separator
        # can be decided here: an entry of zero messages is b"" and takes no leading comma.
        count = encode_count(expected_count + len(added) if new_count is None else new_count)
        tail = append_tail(expected_count, added)
        if then is None or ttl_ms <= 0:
            await self.append_raw(key, encode_count(expected_count), count, tail, ttl_ms)
            return
        keys = self._settle_keys(key, then.claimed_head or "")
        try:
            await self._commands.run(
                APPEND_SETTLE, keys, (encode_count(expected_count), count, ttl_ms, tail, *_settled(then))
            )
        except _FAULTS as exc:
            self._fault("append", key, exc)
            if not isinstance(exc, ConnectionError):  # as append_raw: unknown, so dropped
                await self.delete(key)

    async def append_raw(self, key: CacheKey, expected: bytes, count: bytes, tail: bytes, ttl_ms: int) -> None:
        if ttl_ms <= 0:
            await self.delete(key)
            return
        try:
            await self._commands.run(APPEND, self._keys(key), (expected, count, ttl_ms, tail))
        except _FAULTS as exc:
            self._fault("append", key, exc)
            # The script is atomic, so the entry is either untouched (shorter, seen as stale) or fully
            # appended; after a timeout we cannot tell which, so drop it rather than rely on every
            # reader's count check. Not after a connection error: that DEL would fail the same way.
            if not isinstance(exc, ConnectionError):
                await self.delete(key)

    async def move(
        self,
        old: CacheKey,
        new: CacheKey,
        expected_count: int,
        added: list[bytes],
        ttl_ms: int,
        *,
        sealer: ContentSealer,
        then: Settle | None = None,
    ) -> bool:
        return await self.move_raw(
            old,
            new,
            expected=encode_count(expected_count),
            count=encode_count(expected_count + len(added)),
            tail=append_tail(expected_count, added),
            ttl_ms=ttl_ms,
            row=then.row if then is not None else None,
        )

    async def move_raw(
        self,
        old: CacheKey,
        new: CacheKey,
        *,
        expected: bytes,
        count: bytes,
        tail: bytes,
        ttl_ms: int,
        row: bytes | None = None,
    ) -> bool:
        if self._cluster or ttl_ms <= 0:
            return False
        keys = (*self._dropped(new), *self._dropped(old))
        try:
            moved = await self._commands.run(MOVE, keys, (expected, count, ttl_ms, tail, row or b""))
        except _FAULTS as exc:
            self._fault("move", new, exc)
            return False
        return bool(moved == 1)

    async def delete(self, key: CacheKey) -> bool:
        try:
            await self._commands.delete(self._dropped(key))
        except _FAULTS as exc:
            self._fault("delete", key, exc)
            return False
        return True

    async def delete_many(self, keys: Sequence[CacheKey]) -> bool:
        for start in range(0, len(keys), _DELETE_BATCH):
            # One DEL per entry keeps every command inside a single slot (Cluster cannot run one across slots).
            batch = keys[start : start + _DELETE_BATCH]
            try:
                await self._commands.delete_each([self._dropped(key) for key in batch])
            except _FAULTS as exc:
                # Stop at the first failed batch: Redis is likely down and the rest would fail slowly.
                # Entries left behind expire with their TTL and the database no longer serves them.
                self._fault("delete_many", None, exc)
                return False
        return True

    async def ping(self) -> bool:
        try:
            return await self._commands.ping()
        except _FAULTS as exc:
            self._fault("ping", None, exc)
            return False

    async def aclose(self) -> None:
        """Nothing of its own to close: the client is the process's, shared with the event log."""
