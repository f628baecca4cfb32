"""The connections of PostgreSQL's hot statements (store/pg_hot_path.py): a pool that only lends and takes back.

asyncpg's own pool spends 30-40 us of CPU per acquire and release (a task per release, its bookkeeping), more than
a prepared statement's execution costs the client; a turn takes two. These statements keep no session state (no
transactions left open, no SET, LISTEN, cursors or advisory locks), so a connection goes back as it is, and one that
failed in any way but a plain error reply from the server is closed rather than reused: after a cancellation, a
timeout or a lost connection its state is unknown.

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


class LeanPool:
    def __init__(self, dsn: str, *, max_size: int, timeout: float, server_settings: dict[str, str]) -> None:
        self._dsn = dsn
        self._max_size = max_size
        self._timeout = timeout
        self._server_settings = server_settings
        self._idle: list[asyncpg.Connection] = []
        self._size = 0  # connections open or being opened, idle or lent
        # Waiters get a connection, or None: a place came free and they may open one.
        self._waiters: deque[asyncio.Future[asyncpg.Connection | None]] = deque()
        self._closed = False

    def acquire(self) -> _Lent:
        return _Lent(self)

    async def _get(self) -> asyncpg.Connection:
        if self._closed:
            raise asyncpg.InterfaceError("the pool is closed")
        while True:
            while self._idle:
                conn = self._idle.pop()
                if not conn.is_closed():
                    return conn
                self._size -= 1
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
                return conn
            found = await self._wait()
            if found is not None:
                return found

    async def _wait(self) -> asyncpg.Connection | None:
        waiter: asyncio.Future[asyncpg.Connection | None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self._timeout):
                return await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.result() is not None:
                # Handed a connection just as the wait ended: it goes back, not astray.
                self._put(waiter.result(), reusable=True)
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            raise

    def _put(self, conn: asyncpg.Connection, *, reusable: bool) -> None:
        if self._closed or not reusable or conn.is_closed() or conn.is_in_transaction():
            conn.terminate()
            self._size -= 1
            self._wake_one()
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return
        self._idle.append(conn)

    def _wake_one(self) -> None:
        wake_first(self._waiters)

    async def close(self) -> None:
        """Close the idle connections now; a lent one is closed when it comes back."""
        self._closed = True
        idle, self._idle = self._idle, []
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

    __slots__ = ("_conn", "_pool")

    def __init__(self, pool: LeanPool) -> None:
        self._pool = pool
        self._conn: asyncpg.Connection | None = None

    async def __aenter__(self) -> Any:
        self._conn = await self._pool._get()
        return self._conn

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        assert self._conn is not None
        # An error reply leaves the connection as it was; anything else (a cancellation, a timeout, a lost
        # connection, a bug) may have left it mid-protocol.
        self._pool._put(self._conn, reusable=error is None or isinstance(error, asyncpg.PostgresError))
        self._conn = None
