"""The hot copy of each thread's history: its stored messages as one pre-joined byte string.

The database is the source of truth. A cache entry says how many messages it holds, and the caller
compares that with the thread's position in the database, so an entry that is missing, shorter or
longer is simply rebuilt from the database. That is why every fault here degrades to a miss: losing
the cache (or a write to it) costs a rebuild, never data. What an entry is (its key, its contents, the format of
its count) is store/cache_entry.py; this module keeps entries in Redis.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Protocol

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError

from statestore.content_keys import ContentSealer
from statestore.store.cache_entry import CachedHistory, CacheKey, decode_count, encode_count
from statestore.store.redis_commands import ClusterCommands, RedisCommands, StandaloneCommands
from statestore.store.resp import Script, split_cluster_flag
from statestore.store.resp_reader import RespError

logger = logging.getLogger(__name__)


class HistoryCache(Protocol):
    """Where a thread's pre-joined history is kept between turns; every method is fault-free for callers.

    Every write names the `sealer` of the entry's erasure scope (`await content.sealer(scope)`, CLEAR when encryption
    is off): with encryption on the cache is a SealedCache (store/sealed_cache.py) and seals what it writes with it;
    a clear cache ignores it."""

    @property
    def errors(self) -> int:
        """Faults swallowed so far (exported as a metric)."""
        ...

    async def get(self, key: CacheKey) -> CachedHistory | None: ...

    async def put(self, key: CacheKey, history: CachedHistory, ttl_ms: int, *, sealer: ContentSealer) -> None: ...

    async def append(
        self,
        key: CacheKey,
        expected_count: int,
        added: list[bytes],
        ttl_ms: int,
        *,
        sealer: ContentSealer,
        new_count: int | None = None,
    ) -> None:
        """Append `added` if the entry holds exactly `expected_count` messages and refresh its TTL;
        otherwise (missing or stale) drop the entry so the next read rebuilds it. Atomic. `new_count`: the count
        after, when the caller counts something else than joined messages (default `expected_count + len(added)`)."""
        ...

    async def move(
        self,
        old: CacheKey,
        new: CacheKey,
        expected_count: int,
        added: list[bytes],
        ttl_ms: int,
        *,
        sealer: ContentSealer,
    ) -> bool:
        """The entry of `old`, if it holds `expected_count`, becomes `new`'s with `added` appended (a chain's
        head moving on: the bytes are not sent again). Atomic; the old entry is gone afterwards. False when nothing
        moved (missing, stale, a fault, or a cache that cannot move between keys): the caller puts instead."""
        ...

    async def delete(self, key: CacheKey) -> bool:
        """Whether the entry is surely gone (False: the cache could not be reached)."""

    async def delete_many(self, keys: Sequence[CacheKey]) -> bool:
        """Whether every entry is surely gone."""

    async def ping(self) -> bool: ...

    async def aclose(self) -> None: ...

    @property
    def kind(self) -> str: ...


class FrameStore(Protocol):
    """What a SealedCache (store/sealed_cache.py) keeps its entries in: raw bytes and a count string, appended and
    moved by the same atomic steps as a clear entry, with no separator of its own (the frames carry theirs)."""

    async def get_raw(self, key: CacheKey) -> tuple[bytes, bytes] | None:
        """(count as stored, bytes), or None."""
        ...

    async def put_raw(self, key: CacheKey, count: bytes, data: bytes, ttl_ms: int) -> None: ...

    async def append_raw(self, key: CacheKey, expected: bytes, count: bytes, tail: bytes, ttl_ms: int) -> None: ...

    async def move_raw(
        self, old: CacheKey, new: CacheKey, *, expected: bytes, count: bytes, tail: bytes, ttl_ms: int
    ) -> bool: ...

    async def delete(self, key: CacheKey) -> bool: ...


def append_tail(expected_count: int, added: list[bytes]) -> bytes:
    """What an append adds to an entry of `expected_count` messages: an entry of none is b"" and takes no comma."""
    tail = b",".join(added)
    return b"," + tail if expected_count > 0 and added else tail


# ---------------------------------------------------------------------------------------------------
# Redis
# ---------------------------------------------------------------------------------------------------

# Both scripts run their writes with pcall and, if any fails (OOM, WRONGTYPE, a bad TTL), delete the
# thread's keys before returning the error: a half-applied write could leave a count that matches
# bytes it does not describe, and that would be served as valid. DEL is allowed even under OOM.
_APPLY_OR_DROP = """
local function apply_or_drop(steps)
  for _, step in ipairs(steps) do
    local reply = redis.pcall(unpack(step))
    if type(reply) == 'table' and reply.err then
      redis.call('DEL', KEYS[1], KEYS[2])
      return reply
    end
  end
  return 1
end
"""

# KEYS: joined, count. ARGV: joined bytes, count, ttl ms.
_PUT_LUA = (
    _APPLY_OR_DROP
    + """
return apply_or_drop({
  {'SET', KEYS[1], ARGV[1], 'PX', ARGV[3]},
  {'SET', KEYS[2], ARGV[2], 'PX', ARGV[3]},
})
"""
)

# KEYS: joined, count. ARGV: expected count, new count, ttl ms, bytes to append (separator included).
# The count is compared as the decimal string we wrote; pcall turns a wrong-typed key into a mismatch.
_APPEND_LUA = (
    _APPLY_OR_DROP
    + """
if redis.pcall('GET', KEYS[2]) ~= ARGV[1] or redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('DEL', KEYS[1], KEYS[2])
  return 0
end
return apply_or_drop({
  {'APPEND', KEYS[1], ARGV[4]},
  {'SET', KEYS[2], ARGV[2], 'PX', ARGV[3]},
  {'PEXPIRE', KEYS[1], ARGV[3]},
})
"""
)

# KEYS: new joined, new count, old joined, old count. ARGV: expected count, new count, ttl ms, bytes to append.
# Standalone Redis only: the old and new keys are under different hash tags, so in different Cluster slots.
_MOVE_LUA = (
    _APPLY_OR_DROP
    + """
if redis.pcall('GET', KEYS[4]) ~= ARGV[1] or redis.call('EXISTS', KEYS[3]) == 0 then
  redis.call('DEL', KEYS[3], KEYS[4])
  return 0
end
redis.call('RENAME', KEYS[3], KEYS[1])
redis.call('DEL', KEYS[4])
return apply_or_drop({
  {'APPEND', KEYS[1], ARGV[4]},
  {'SET', KEYS[2], ARGV[2], 'PX', ARGV[3]},
  {'PEXPIRE', KEYS[1], ARGV[3]},
})
"""
)

_PUT = Script(_PUT_LUA)
_APPEND = Script(_APPEND_LUA)
_MOVE = Script(_MOVE_LUA)

# Errors a cache call may raise; all of them mean "behave like a miss". OSError covers the lean client's
# ConnectionError and TimeoutError, and socket errors that escape redis-py's wrapping in cluster mode. RuntimeError is
# what uvloop raises for a write on a transport that a reset just closed, before the client notices it is gone.
_FAULTS = (RespError, RedisError, RedisClusterException, OSError, RuntimeError)

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

    def __init__(self, url: str, prefix: str, *, socket_timeout: float = 0.5, max_connections: int = 64) -> None:
        if "{" in prefix or "}" in prefix:
            # A brace in the prefix would become the hash tag and put every thread in one slot.
            raise ValueError("the redis key prefix must not contain '{' or '}'")
        self._prefix = prefix
        url, cluster = split_cluster_flag(url)
        self._commands: RedisCommands
        self._cluster = cluster
        if cluster:
            self._commands = ClusterCommands(url, timeout_s=socket_timeout, max_connections=max_connections)
        else:
            # Commands share connections (several in flight on each), so no pool size is needed.
            self._commands = StandaloneCommands(url, timeout_s=socket_timeout)
        self._gate = _WarningGate()
        self.errors = 0

    @property
    def kind(self) -> str:
        return "redis"

    def _keys(self, key: CacheKey) -> tuple[str, str]:
        tagged = f"{self._prefix}{{{key.name}}}"
        return f"{tagged}:h", f"{tagged}:n"

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
        decoded = decode_count(count)
        if decoded is None:
            return None
        n, version = decoded
        # The two keys can disagree only through outside interference; do not serve that.
        if n < 0 or (n == 0) != (joined == b""):
            return None
        return CachedHistory(n, joined, version)

    async def put(self, key: CacheKey, history: CachedHistory, ttl_ms: int, *, sealer: ContentSealer) -> None:
        await self.put_raw(key, encode_count(history.count, history.version), history.joined, ttl_ms)

    async def put_raw(self, key: CacheKey, count: bytes, data: bytes, ttl_ms: int) -> None:
        if ttl_ms <= 0:
            await self.delete(key)
            return
        try:
            await self._commands.run(_PUT, self._keys(key), (data, count, ttl_ms))
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
    ) -> None:
        # The script appends only when the entry holds `expected_count` messages, so the separator
        # can be decided here: an entry of zero messages is b"" and takes no leading comma.
        count = expected_count + len(added) if new_count is None else new_count
        await self.append_raw(
            key, encode_count(expected_count), encode_count(count), append_tail(expected_count, added), ttl_ms
        )

    async def append_raw(self, key: CacheKey, expected: bytes, count: bytes, tail: bytes, ttl_ms: int) -> None:
        if ttl_ms <= 0:
            await self.delete(key)
            return
        try:
            await self._commands.run(_APPEND, self._keys(key), (expected, count, ttl_ms, tail))
        except _FAULTS as exc:
            self._fault("append", key, exc)
            # The script is atomic, so the entry is either untouched (shorter, seen as stale) or fully
            # appended; after a timeout we cannot tell which, so drop it rather than rely on every
            # reader's count check. Not after a connection error: that DEL would fail the same way.
            if not isinstance(exc, (ConnectionError, RedisConnectionError)):
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
    ) -> bool:
        return await self.move_raw(
            old,
            new,
            expected=encode_count(expected_count),
            count=encode_count(expected_count + len(added)),
            tail=append_tail(expected_count, added),
            ttl_ms=ttl_ms,
        )

    async def move_raw(
        self, old: CacheKey, new: CacheKey, *, expected: bytes, count: bytes, tail: bytes, ttl_ms: int
    ) -> bool:
        if self._cluster or ttl_ms <= 0:
            return False
        keys = (*self._keys(new), *self._keys(old))
        try:
            moved = await self._commands.run(_MOVE, keys, (expected, count, ttl_ms, tail))
        except _FAULTS as exc:
            self._fault("move", new, exc)
            return False
        return bool(moved == 1)

    async def delete(self, key: CacheKey) -> bool:
        try:
            await self._commands.delete(self._keys(key))
        except _FAULTS as exc:
            self._fault("delete", key, exc)
            return False
        return True

    async def delete_many(self, keys: Sequence[CacheKey]) -> bool:
        for start in range(0, len(keys), _DELETE_BATCH):
            # One DEL per entry keeps every command inside a single slot (Cluster cannot run one across slots).
            batch = keys[start : start + _DELETE_BATCH]
            try:
                await self._commands.delete_each([self._keys(key) for key in batch])
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
        try:
            await self._commands.aclose()
        except _FAULTS as exc:
            self._fault("close", None, exc)
