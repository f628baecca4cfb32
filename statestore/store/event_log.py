"""The events of background responses, kept so a client resumes a stream on any replica (docs/responses.md, "Resumable
streams"): a Redis Stream per response, or, on the embedded default without Redis, the process's memory.

An event's stream id is its sequence number (`0-<n+1>`), so the stream itself refuses a number written twice, and
every entry carries the attempt (the claim) of the run that wrote it. A publish is one script: it writes nothing when
the stream already holds a later attempt's events or the numbers it would write, so two runs of one turn never make
one stream that mixes their events. Streams are capped and expire with the response.

Redis, standalone or Cluster, is spoken to by the process's one client (store/resp.py, store/resp_cluster.py; built by
statestore/resources.py, shared with the history cache), with a timeout of the event log's own on each call, and a
follower's blocking XREAD on a connection of its own while it waits."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from statestore.content_keys import Scope
from statestore.store.resp import RedisClient, Script
from statestore.store.resp_reader import RespError

log = logging.getLogger(__name__)

# What a Redis that cannot be reached raises: the client's RedisConnectionError and RedisTimeout (OSErrors), and
# uvloop's RuntimeError for a write on a transport that a reset closed (as the history cache takes them:
# statestore/store/redis_cache.py).
_UNREACHABLE = (OSError, RuntimeError)


@dataclass(frozen=True, slots=True)
class Event:
    seq: int
    frame: bytes  # the event as a client receives it (SSE)
    final: bool = False  # the response's last event


class Superseded(Exception):
    """A later run of the turn owns its stream (or holds these numbers): this run must stop."""


class EventLogUnavailable(Exception):
    """The event store cannot be reached: events are not kept (a resume then replays from storage)."""


class EventLog(Protocol):
    async def publish(
        self, response_id: str, attempt: int, events: Sequence[Event], ttl_ms: int, *, scope: Scope | None = None
    ) -> None:
        """`scope`: the turn's erasure scope (a sealed log seals the frames under it; store/sealed_events.py)."""
        ...

    async def read(self, response_id: str, after: int, *, block_ms: int) -> list[Event]:
        """Events numbered above `after`, oldest first; waits up to `block_ms` for one when there is none yet."""
        ...

    async def last(self, response_id: str) -> tuple[int, int] | None:
        """(the last event's number, the attempt that wrote it), or None when the response has no events kept."""
        ...

    async def aclose(self) -> None: ...


# KEYS[1]: the stream. ARGV: attempt, ttl ms, cap, then (id, frame, final) per event. Checked before anything is
# written, so a refused publish leaves the stream as it was. A batch the same run already wrote (a publish sent again
# because its answer was lost with the connection) is taken as written: the script is atomic, so a batch is there
# whole or not at all.
_PUBLISH = Script("""
local top = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if #top > 0 then
  local fields = top[1][2]
  local attempt = nil
  for i = 1, #fields, 2 do
    if fields[i] == 'a' then attempt = tonumber(fields[i + 1]) end
  end
  if attempt ~= nil and attempt > tonumber(ARGV[1]) then
    return redis.error_reply('SUPERSEDED later attempt')
  end
  local last = tonumber(string.match(top[1][1], '%-(%d+)$'))
  local first = tonumber(string.match(ARGV[4], '%-(%d+)$'))
  if first <= last then
    local final = tonumber(string.match(ARGV[#ARGV - 2], '%-(%d+)$'))
    if attempt == tonumber(ARGV[1]) and final <= last then
      return 0
    end
    return redis.error_reply('SUPERSEDED numbers taken')
  end
end
for i = 4, #ARGV, 3 do
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[3], ARGV[i], 'a', ARGV[1], 'f', ARGV[i + 1], 'z', ARGV[i + 2])
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
""")


# Each command's bound, given on each call (the client's own is the cache's, 0.5 s), and a blocking read's beyond its
# wait: a publish is a run's events, which a client resuming its stream needs, so it may wait out a slow moment the
# cache would not; short enough that a Redis that hangs stops a run's publishing, not the run.
_TIMEOUT_S = 5.0


def _entry_id(seq: int) -> str:
    return f"0-{seq + 1}"


def _seq_of(entry_id: bytes | str) -> int:
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.rpartition("-")[2]) - 1


def _event(entry: Any) -> Event:
    """An entry as store/resp.py reads it: [id, [field, value, ...]]."""
    entry_id, flat = entry
    fields = dict(zip(flat[::2], flat[1::2], strict=True))
    return Event(_seq_of(entry_id), fields[b"f"], fields.get(b"z") == b"1")


class RedisEventLog:
    """A publish is one script, a read an XRANGE, and a follower's wait an XREAD BLOCK on a connection of its own
    (RespClient.blocking), so a waiting follower holds up no publish. On a Redis Cluster each goes to the node of the
    response's stream (its id is the key's hash tag)."""

    def __init__(self, client: RedisClient, prefix: str, *, cap: int) -> None:
        self._client = client
        self._prefix = prefix
        self._cap = cap

    def _key(self, response_id: str) -> str:
        return f"{self._prefix}bg:{{{response_id}}}:events"

    async def publish(
        self, response_id: str, attempt: int, events: Sequence[Event], ttl_ms: int, *, scope: Scope | None = None
    ) -> None:
        if not events:
            return
        args: list[Any] = [attempt, max(ttl_ms, 1000), self._cap]
        for event in events:
            args += [_entry_id(event.seq), event.frame, 1 if event.final else 0]
        # A publish the client sends again on a fresh connection (statestore/retry_policy.py) finds its batch written
        # if the first one was: the script takes it as written.
        try:
            await _PUBLISH.run(self._client, [self._key(response_id)], args, timeout_s=_TIMEOUT_S)
        except RespError as exc:
            if "SUPERSEDED" in str(exc):
                raise Superseded(str(exc)) from None
            raise EventLogUnavailable(type(exc).__name__) from exc
        except _UNREACHABLE as exc:
            raise EventLogUnavailable(type(exc).__name__) from exc

    async def read(self, response_id: str, after: int, *, block_ms: int) -> list[Event]:
        key = self._key(response_id)
        try:
            flat = await self._client.execute(
                "XRANGE", key, _entry_id(after + 1), "+", "COUNT", 1000, timeout_s=_TIMEOUT_S
            )
            if not flat and block_ms > 0:
                streams = await self._client.blocking(
                    *("XREAD", "COUNT", 1000, "BLOCK", block_ms, "STREAMS", key, _entry_id(after)),
                    wait_s=block_ms / 1000,
                    timeout_s=_TIMEOUT_S,
                )
                flat = streams[0][1] if streams else []
        except _UNREACHABLE as exc:
            raise EventLogUnavailable(type(exc).__name__) from exc
        return [_event(entry) for entry in flat]

    async def last(self, response_id: str) -> tuple[int, int] | None:
        try:
            top = await self._client.execute(
                "XREVRANGE", self._key(response_id), "+", "-", "COUNT", 1, timeout_s=_TIMEOUT_S
            )
        except _UNREACHABLE as exc:
            raise EventLogUnavailable(type(exc).__name__) from exc
        if not top:
            return None
        entry_id, flat = top[0]
        fields = dict(zip(flat[::2], flat[1::2], strict=True))
        return _seq_of(entry_id), int(fields.get(b"a", b"0"))

    async def aclose(self) -> None:
        """Nothing of its own to close: the client is the process's (statestore/resources.py closes it)."""


@dataclass(slots=True)
class _Kept:
    attempt: int = 0
    events: list[Event] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class MemoryEventLog:
    """The embedded default's: one process serves every request, so its memory is every replica's. The most recent
    `streams` responses are kept."""

    def __init__(self, *, cap: int, streams: int = 1000) -> None:
        self._cap = cap
        self._streams = streams
        self._kept: OrderedDict[str, _Kept] = OrderedDict()

    async def publish(
        self, response_id: str, attempt: int, events: Sequence[Event], ttl_ms: int, *, scope: Scope | None = None
    ) -> None:
        if not events:
            return
        kept = self._kept.get(response_id)
        if kept is None:
            kept = self._kept[response_id] = _Kept()
            while len(self._kept) > self._streams:
                self._kept.popitem(last=False)
        if kept.events and (kept.attempt > attempt or events[0].seq <= kept.events[-1].seq):
            if kept.attempt == attempt and events[-1].seq <= kept.events[-1].seq:
                return  # this run's batch, written already (as the Redis script takes it)
            raise Superseded("a later attempt owns the stream")
        kept.attempt = attempt
        kept.events.extend(events)
        del kept.events[: max(0, len(kept.events) - self._cap)]
        kept.changed.set()
        kept.changed = asyncio.Event()

    async def read(self, response_id: str, after: int, *, block_ms: int) -> list[Event]:
        kept = self._kept.get(response_id)
        found = [event for event in kept.events if event.seq > after] if kept is not None else []
        if found or block_ms <= 0:
            return found
        if kept is None:
            await asyncio.sleep(block_ms / 1000)
            return []
        try:
            await asyncio.wait_for(kept.changed.wait(), block_ms / 1000)
        except TimeoutError:
            return []
        return [event for event in kept.events if event.seq > after]

    async def last(self, response_id: str) -> tuple[int, int] | None:
        kept = self._kept.get(response_id)
        if kept is None or not kept.events:
            return None
        return kept.events[-1].seq, kept.attempt

    async def aclose(self) -> None:
        self._kept.clear()


def create_event_log(redis: RedisClient | None, prefix: str, *, cap: int) -> EventLog:
    """On the process's Redis client when there is one (statestore/resources.py), else in its memory."""
    if redis is not None:
        return RedisEventLog(redis, prefix, cap=cap)
    return MemoryEventLog(cap=cap)
