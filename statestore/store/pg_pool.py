"""The connections of PostgreSQL's hot statements (store/pg_hot_path.py): a pool that only lends and takes back.

asyncpg's own pool spends 30-40 us of CPU per acquire and release (a task per release, its bookkeeping), more than
a prepared statement's execution costs the client; a turn takes two. These statements keep no session state (no
transactions left open, no SET, LISTEN, cursors or advisory locks) but the one the pool sets itself, so a connection
goes back as it is, and one that failed in any way but a plain error reply from the server is closed rather than
reused: after a cancellation, a timeout or a lost connection its state is unknown.

Two kinds of use share one bound. A durable statement runs on a connection with the server's `synchronous_commit`;
one that need not wait for its WAL flush (`durable=False`: taking, renewing, giving back a lease) on a connection set
to `synchronous_commit = off`. The pool keeps the idle connections of each kind apart, so a connection is switched
(one `SET` or `RESET`, a round trip) only when one kind has none idle and no place is left to open one: the process
holds at most `max_size` connections whatever the mix (docs/deployment.md, the connection budget).

Bounds, as asyncpg's pool had them: at most `max_size` connections, made on first use; a caller waits at most
`timeout` for one (then TimeoutError), a connect at most `timeout`, a statement at most `timeout` (command_timeout).
"""

from __future__ import annotations

import asyncio
from collections import deque
from types import TracebackType
from typing import Any

import asyncpg

from statestore.waiters import wake_first

# What a connection of each kind is told when it is made or switched (RESET: back to the server's own setting).
_SET = {True: "RESET synchronous_commit", False: "SET synchronous_commit TO off"}


class LeanPool:
    def __init__(self, dsn: str, *, max_size: int, timeout: float, server_settings: dict[str, str]) -> None:
        self._dsn = dsn
        self._max_size = max_size
        self._timeout = timeout
        self._server_settings = server_settings
        # Idle connections by kind: durable (the server's synchronous_commit) or not (off).
        self._idle: dict[bool, list[asyncpg.Connection]] = {True: [], False: []}
        self._size = 0  # connections open or being opened, idle or lent
        # Waiters get a connection and its kind, or None: a place came free and they may open one.
        self._waiters: deque[asyncio.Future[tuple[asyncpg.Connection, bool] | None]] = deque()
        self._closed = False

    def acquire(self, *, durable: bool = True) -> _Lent:
        return _Lent(self, durable)

    async def _get(self, durable: bool) -> asyncpg.Connection:
        if self._closed:
            raise asyncpg.InterfaceError("the pool is closed")
        while True:
            conn = self._idle_of(durable)
            if conn is not None:
                return conn
            if self._size < self._max_size:
                self._size += 1
                try:
                    conn = await asyncpg.connect(
                        self._dsn,
                        timeout=self._timeout,
                        command_timeout=self._timeout,
                        server_settings=self._server_settings,
                    )
                except BaseException:
                    self._size -= 1
                    self._wake_one()
                    raise
                if not durable:
                    await self._switch(conn, durable)
                return conn
            conn = self._idle_of(not durable)
            if conn is not None:
                await self._switch(conn, durable)
                return conn
            if self._size < self._max_size:
                continue  # the other kind's idle connections had closed: their places are free
            found = await self._wait()
            if found is not None:
                conn, kind = found
                if kind != durable:
                    await self._switch(conn, durable)
                return conn

    def _idle_of(self, durable: bool) -> asyncpg.Connection | None:
        idle = self._idle[durable]
        while idle:
            conn = idle.pop()
            if not conn.is_closed():
                return conn
            self._size -= 1
        return None

    async def _switch(self, conn: asyncpg.Connection, durable: bool) -> None:
        try:
            await conn.execute(_SET[durable])
        except BaseException:
            conn.terminate()
            self._size -= 1
            self._wake_one()
            raise

    async def _wait(self) -> tuple[asyncpg.Connection, bool] | None:
        waiter: asyncio.Future[tuple[asyncpg.Connection, bool] | None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self._timeout):
                return await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled() and (handed := waiter.result()) is not None:
                # Handed a connection just as the wait ended: it goes back, not astray.
                self._put(*handed, reusable=True)
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            raise

    def _put(self, conn: asyncpg.Connection, durable: bool, *, reusable: bool) -> None:
        if self._closed or not reusable or conn.is_closed() or conn.is_in_transaction():
            conn.terminate()
            self._size -= 1
            self._wake_one()
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result((conn, durable))
                return
        self._idle[durable].append(conn)

    def _wake_one(self) -> None:
        wake_first(self._waiters)

    async def close(self) -> None:
        """Close the idle connections now; a lent one is closed when it comes back."""
        self._closed = True
        idle = self._idle[True] + self._idle[False]
        self._idle = {True: [], False: []}
        for conn in idle:
            try:
                await asyncio.wait_for(conn.close(), self._timeout)
            except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError):
                conn.terminate()
        self._size -= len(idle)
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(asyncpg.InterfaceError("the pool is closed"))


class _Lent:
    """`async with pool.acquire() as conn`: lent for the block; back on exit, closed if the block failed."""

    __slots__ = ("_conn", "_durable", "_pool")

    def __init__(self, pool: LeanPool, durable: bool) -> None:
        self._pool = pool
        self._durable = durable
        self._conn: asyncpg.Connection | None = None

    async def __aenter__(self) -> Any:
        self._conn = await self._pool._get(self._durable)
        return self._conn

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        assert self._conn is not None
        # An error reply leaves the connection as it was; anything else (a cancellation, a timeout, a lost
        # connection, a bug) may have left it mid-protocol.
        self._pool._put(self._conn, self._durable, reusable=error is None or isinstance(error, asyncpg.PostgresError))
        self._conn = None
