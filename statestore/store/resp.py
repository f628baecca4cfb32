"""statestore's one Redis client (the history cache, claims, heads, background events): RESP2 over asyncio protocols,
commands framed by hiredis, replies read by store/resp_reader.py. A process builds one (statestore/resources.py), so
one pool and one breaker (a Cluster's: per node) serve everything it keeps in Redis; each call may bound its own wait
(`timeout_s`: the event log's is longer than the cache's, the client's own).

Why not redis-py: every turn reads and appends its thread's history, and redis-py spends 60-90 us of CPU per
command on its pool, locks, a task per write (`asyncio.wait_for`) and timeout contexts, against about 15 us for the
command itself (bench/README.md). This client keeps several commands in flight on one connection (Redis answers in
order, so a FIFO of futures matches replies to requests), arms one timer per command, and writes each command with
one `writelines`. A Redis Cluster is spoken to by a client of these per node (store/resp_cluster.py).

Every failure is an exception the cache takes as a miss: `RespError` (an error reply), `RedisConnectionError` (the
connection failed or was lost; `RedisSkipped` while the breaker skips Redis) and `RedisTimeout` (no reply in time; the
connection is then dropped, as a reply that arrives late would otherwise be matched to the wrong request). Both are
OSErrors (a ConnectionError, a TimeoutError).

Retries and the breaker follow statestore/retry_policy.py: a command that failed on a connection found dead goes once
more on a fresh one, a timeout never; after an outage (a timeout, a connection refused or lost) the client skips Redis
for a pause (RedisBreaker), so a black-holed Redis costs a process one timeout per pause, not one per command.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import hiredis

from statestore.retry_policy import REDIS_BACKOFF_MAX_S, REDIS_BACKOFF_S, STALE_CONNECTION_RETRIES
from statestore.store.resp_reader import RedisConnectionError, RedisTimeout, RespError, RespProtocolError, RespReader

Arg = bytes | str | int


_TRUE_FLAGS = {"1", "true", "yes", "on"}


def split_cluster_flag(url: str) -> tuple[str, bool]:
    """Strip our `cluster=1` query flag (no option of a connection: it picks store/resp_cluster.py) and report it."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    flags = [value.lower() for key, value in query if key == "cluster"]
    if not flags:
        return url, False
    if flags[-1] not in _TRUE_FLAGS | {"0", "false", "no", "off"}:
        raise ValueError("the redis URL's cluster flag must be 1/true or 0/false")
    rest = urlencode([(key, value) for key, value in query if key != "cluster"])
    return urlunsplit(parts._replace(query=rest)), flags[-1] in _TRUE_FLAGS


@dataclass(frozen=True, slots=True)
class Endpoint:
    host: str | None
    port: int
    path: str | None  # a unix socket
    tls: bool
    username: str | None
    password: str | None
    db: int


def parse_url(url: str) -> Endpoint:
    """redis://[[user]:password@]host[:port][/db], rediss://… (TLS), unix:///path[?db=N]; `db`, `username` and
    `password` may also be query parameters. Anything else is refused, so a setting is never silently ignored."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError("the redis URL must be a redis://, rediss:// or unix:// URL")
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    unknown = sorted(set(query) - {"db", "username", "password"})
    if unknown:
        raise ValueError(f"the redis URL has options statestore does not support: {', '.join(unknown)}")
    db_text = query.get("db") or (parts.path.strip("/") if parts.scheme != "unix" else "") or "0"
    if not db_text.isdigit():
        raise ValueError("the redis URL's database must be a number")
    username = query.get("username") or (unquote(parts.username) if parts.username else None)
    password = query.get("password") or (unquote(parts.password) if parts.password else None)
    if parts.scheme == "unix":
        return Endpoint(None, 0, parts.path, False, username, password, int(db_text))
    return Endpoint(
        parts.hostname or "localhost",
        parts.port or 6379,
        None,
        parts.scheme == "rediss",
        username,
        password,
        int(db_text),
    )


def pack(args: Sequence[Arg]) -> bytes:
    """A command in RESP2, framed by hiredis in C: a Python loop over a script call's dozen arguments cost a turn
    about 300 bytecodes, more than any other function of it (a large value is copied once into the frame, a
    memcpy)."""
    # hiredis's stub types the argument as a tuple of one: any tuple of these is what it takes.
    packed: bytes = hiredis.pack_command(cast(Any, args if isinstance(args, tuple) else tuple(args)))
    return packed


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self._reader = RespReader(self._reply)
        self._waiters: deque[asyncio.Future[Any]] = deque()
        self._transport: asyncio.Transport | None = None
        self.closed = False

    @property
    def in_flight(self) -> int:
        return len(self._waiters)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not subclasses of asyncio.Transport, though they implement it.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self._reader.feed(data)
        except RespProtocolError as exc:
            self._fail(exc)

    def _reply(self, reply: Any) -> None:
        if not self._waiters:
            raise RespProtocolError("redis protocol error: a reply to no command")
        waiter = self._waiters.popleft()
        if not waiter.done():
            waiter.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(RedisConnectionError("the redis connection was lost"))

    def _fail(self, exc: BaseException) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.abort()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(exc)

    def _expire(self, waiter: asyncio.Future[Any], timeout_s: float) -> None:
        if not waiter.done():
            self._fail(RedisTimeout(f"no reply from redis within {timeout_s:g} s"))

    async def send(self, commands: Sequence[Sequence[Arg]], timeout_s: float) -> list[Any]:
        """Write commands back to back and wait up to `timeout_s` for their replies (error replies are returned, not
        raised). The timeout is the caller's: commands of several kinds share a connection (the cache's, the event
        log's), each waiting as long as its own kind may."""
        if self.closed or self._transport is None:
            raise RedisConnectionError("the redis connection is closed")
        loop = asyncio.get_running_loop()
        chunks = [pack(command) for command in commands]
        try:
            self._transport.writelines(chunks)
        except RuntimeError:  # uvloop's, for a transport a reset closed before connection_lost reached us
            self._fail(RedisConnectionError("the redis connection was lost"))
            raise RedisConnectionError("the redis connection was lost") from None
        waiters = []
        for _ in commands:
            waiter: asyncio.Future[Any] = loop.create_future()
            self._waiters.append(waiter)
            waiters.append(waiter)
        timer = loop.call_later(timeout_s, self._expire, waiters[-1], timeout_s)
        try:
            return [await waiter for waiter in waiters]
        finally:
            timer.cancel()

    def close(self) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.close()


class RedisSkipped(RedisConnectionError):
    """Redis is not asked: it failed moments ago and the breaker's pause is not over."""


class RedisBreaker:
    """After an outage (a timeout, a refused or lost connection) Redis is skipped for a pause, doubled at each outage in
    a row up to a maximum (statestore/retry_policy.py's numbers); the first call after the pause probes Redis, the
    others go on skipping it until the probe succeeds. A pause of 0 turns the breaker off."""

    def __init__(self, backoff_s: float = REDIS_BACKOFF_S, max_s: float = REDIS_BACKOFF_MAX_S) -> None:
        self._backoff_s = backoff_s
        self._max_s = max_s
        self._pause_s = 0.0
        self._until = 0.0  # skip Redis before this (monotonic seconds)

    def skips(self) -> bool:
        """True while Redis is skipped; False lets a call through (after a pause, as its probe)."""
        if self._pause_s == 0.0:
            return False
        now = time.monotonic()
        if now < self._until:
            return True
        self._until = now + self._pause_s  # this call probes; the others skip until it settles
        return False

    def failed(self) -> None:
        self._pause_s = min(self._max_s, self._pause_s * 2 if self._pause_s else self._backoff_s)
        self._until = time.monotonic() + self._pause_s

    def succeeded(self) -> None:
        self._pause_s = 0.0


# What says Redis itself is unreachable or hung, not an error reply about one command. RuntimeError is uvloop's, for a
# write on a transport a reset just closed.
OUTAGES = (OSError, RuntimeError)


# How long a command may wait for its reply unless its caller says otherwise: the history cache's, claims' and heads'
# bound (a turn served from the database beats one that waits on Redis). The event log gives its own (a publish may
# wait longer: store/event_log.py).
COMMAND_TIMEOUT_S = 0.5


class RedisClient(Protocol):
    """What statestore asks of Redis: a standalone one's client (RespClient) or a Cluster's (store/resp_cluster.py).
    A process holds one, built by statestore/resources.py and shared by the cache, claims, heads and event log; each
    call may give its own `timeout_s` (the client's, COMMAND_TIMEOUT_S unless built with another, when not)."""

    async def pipeline(
        self, commands: Sequence[Sequence[Arg]], *, probe: bool = False, timeout_s: float | None = None
    ) -> list[Any]: ...

    async def execute(self, *command: Arg, timeout_s: float | None = None) -> Any: ...

    async def blocking(self, *command: Arg, wait_s: float, timeout_s: float | None = None) -> Any: ...

    async def aclose(self) -> None: ...


class RespClient:
    """Up to `connections` connections, each carrying many commands at once; the least busy one takes the next."""

    def __init__(
        self,
        url: str | Endpoint,
        *,
        timeout_s: float = COMMAND_TIMEOUT_S,
        connections: int = 4,
        breaker: RedisBreaker | None = None,
    ) -> None:
        self._endpoint = url if isinstance(url, Endpoint) else parse_url(url)
        self._timeout_s = timeout_s
        self.breaker = breaker or RedisBreaker()
        self._slots: list[_Connection | None] = [None] * connections
        self._connecting: list[asyncio.Future[_Connection] | None] = [None] * connections
        # Blocking reads' connections, one per read while it waits (a command blocked on a shared connection would
        # hold up every command queued behind it); up to `connections` idle ones are kept for the next reads.
        self._idle_blocking: list[_Connection] = []
        self._blocking: set[_Connection] = set()
        self._idle_limit = connections

    async def _connect(self, timeout_s: float) -> _Connection:
        loop = asyncio.get_running_loop()
        end = self._endpoint
        try:
            async with asyncio.timeout(timeout_s):
                if end.path is not None:
                    _, conn = await loop.create_unix_connection(_Connection, end.path)
                else:
                    tls = ssl.create_default_context() if end.tls else None
                    _, conn = await loop.create_connection(_Connection, end.host or "localhost", end.port, ssl=tls)
        except OSError as exc:
            raise RedisConnectionError(f"cannot connect to redis: {type(exc).__name__}: {exc}") from None
        setup: list[list[Arg]] = []
        if end.password is not None:
            setup.append(["AUTH", end.username, end.password] if end.username else ["AUTH", end.password])
        if end.db:
            setup.append(["SELECT", end.db])
        if setup:
            for reply in await conn.send(setup, timeout_s):
                if isinstance(reply, RespError):
                    conn.close()
                    raise reply
        return conn

    async def _connection(self, timeout_s: float) -> _Connection:
        """An idle connection, else a new one while there is room, else the least busy."""
        best: _Connection | None = None
        free_slot: int | None = None
        for i, conn in enumerate(self._slots):
            if conn is None or conn.closed:
                free_slot = i if free_slot is None else free_slot
            elif conn.in_flight == 0:
                return conn
            elif best is None or conn.in_flight < best.in_flight:
                best = conn
        if free_slot is not None:
            return await self._open(free_slot, timeout_s)
        assert best is not None
        return best

    async def _open(self, slot: int, timeout_s: float) -> _Connection:
        """Callers that find the same slot empty share one connect (bound by the first one's timeout); it completes
        even if they are cancelled."""
        pending = self._connecting[slot]
        if pending is None:
            pending = asyncio.ensure_future(self._connect(timeout_s))
            self._connecting[slot] = pending

            def settle(done: asyncio.Future[_Connection]) -> None:
                self._connecting[slot] = None
                if not done.cancelled() and done.exception() is None:
                    self._slots[slot] = done.result()

            pending.add_done_callback(settle)
        return await asyncio.shield(pending)

    async def pipeline(
        self, commands: Sequence[Sequence[Arg]], *, probe: bool = False, timeout_s: float | None = None
    ) -> list[Any]:
        """Replies in order; an error reply is returned as a RespError, not raised. A connection found dead is
        replaced (Redis restarted since it was last used) and the commands sent again on the new one. `probe`: sent
        even while the breaker skips Redis (work no turn waits for, such as deletions owed since an outage), and its
        success ends the pause."""
        if not probe and self.breaker.skips():
            raise RedisSkipped("redis failed moments ago: skipped for now")
        try:
            replies = await self._send(commands, self._timeout_s if timeout_s is None else timeout_s)
        except OUTAGES:
            self.breaker.failed()
            raise
        self.breaker.succeeded()
        return replies

    async def _send(self, commands: Sequence[Sequence[Arg]], timeout_s: float) -> list[Any]:
        retries = STALE_CONNECTION_RETRIES
        while True:
            try:
                return await (await self._connection(timeout_s)).send(commands, timeout_s)
            except RedisConnectionError:
                if not retries:
                    raise
                retries -= 1

    async def execute(self, *command: Arg, timeout_s: float | None = None) -> Any:
        (reply,) = await self.pipeline([command], timeout_s=timeout_s)
        if isinstance(reply, RespError):
            raise reply
        return reply

    async def blocking(self, *command: Arg, wait_s: float, timeout_s: float | None = None, asking: bool = False) -> Any:
        """A command Redis may hold up to `wait_s` (XREAD BLOCK), on a connection of its own while it waits, its reply
        awaited `wait_s` plus `timeout_s`; raised as `execute`'s. A reader cancelled while it waits closes that
        connection: its reply would come to no one. `asking`: sent after ASKING (a Cluster's slot on its way to this
        node, store/resp_cluster.py)."""
        commands: list[Sequence[Arg]] = [("ASKING",), command] if asking else [command]
        if self.breaker.skips():
            raise RedisSkipped("redis failed moments ago: skipped for now")
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        retries = STALE_CONNECTION_RETRIES
        while True:
            conn = await self._blocking_connection(timeout_s)
            try:
                reply = (await conn.send(commands, timeout_s + wait_s))[-1]
            except RedisConnectionError:
                self._blocking.discard(conn)
                if retries:
                    retries -= 1
                    continue
                self.breaker.failed()
                raise
            except OUTAGES:
                self._blocking.discard(conn)
                self.breaker.failed()
                raise
            except BaseException:
                self._blocking.discard(conn)
                conn.close()
                raise
            break
        self.breaker.succeeded()
        if len(self._idle_blocking) < self._idle_limit:
            self._idle_blocking.append(conn)
        else:
            self._blocking.discard(conn)
            conn.close()
        if isinstance(reply, RespError):
            raise reply
        return reply

    async def _blocking_connection(self, timeout_s: float) -> _Connection:
        while self._idle_blocking:
            conn = self._idle_blocking.pop()
            if not conn.closed:
                return conn
            self._blocking.discard(conn)
        try:
            conn = await self._connect(timeout_s)
        except OUTAGES:
            self.breaker.failed()
            raise
        self._blocking.add(conn)
        return conn

    async def aclose(self) -> None:
        for conn in (*self._slots, *self._blocking):
            if conn is not None:
                conn.close()
        self._slots = [None] * len(self._slots)
        self._blocking.clear()
        self._idle_blocking.clear()


class Script:
    """A Lua script run by its SHA1 (EVALSHA), loaded with EVAL when Redis does not know it (a restart, a flush)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()  # noqa: S324 - Redis names scripts by SHA1

    async def run(
        self, client: RedisClient, keys: Sequence[Arg], args: Sequence[Arg], *, timeout_s: float | None = None
    ) -> Any:
        try:
            return await client.execute("EVALSHA", self.sha, len(keys), *keys, *args, timeout_s=timeout_s)
        except RespError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
        return await client.execute("EVAL", self.source, len(keys), *keys, *args, timeout_s=timeout_s)
