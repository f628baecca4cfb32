"""The lean pool of PostgreSQL's hot statements (statestore/store/pg_pool.py) against the real server: it lends and
takes back, stays within its bound, makes a waiter wait no longer than its timeout, and never lends a connection
whose state is unknown. Only SELECTs, on connections of its own."""

from __future__ import annotations

import asyncio
import contextlib

import asyncpg
import pytest

from statestore.store.pg_hot_path import asyncpg_dsn
from statestore.store.pg_pool import LeanPool


@pytest.fixture
async def dsn(postgres_admin_url: str) -> str:
    return asyncpg_dsn(postgres_admin_url)


async def test_a_connection_is_lent_again_and_a_failed_block_closes_it(dsn: str) -> None:
    pool = LeanPool(dsn, max_size=2, timeout=5, server_settings={"application_name": "statestore-test"})
    async with pool.acquire() as conn:
        first = conn.get_server_pid()
    async with pool.acquire() as conn:
        assert conn.get_server_pid() == first  # taken back as it was, lent again
    with pytest.raises(asyncpg.UndefinedTableError):
        async with pool.acquire() as conn:
            await conn.fetchval("SELECT * FROM no_such_table_here")
    async with pool.acquire() as conn:
        assert conn.get_server_pid() == first  # an error reply leaves the connection usable
        assert await conn.fetchval("SHOW application_name") == "statestore-test"
    with pytest.raises(RuntimeError):
        async with pool.acquire() as conn:
            raise RuntimeError("anything but an error reply")
    async with pool.acquire() as conn:
        assert conn.get_server_pid() != first  # its state was unknown: closed, a new one made
    await pool.close()


async def test_a_connection_the_server_ended_is_never_lent(dsn: str) -> None:
    pool = LeanPool(dsn, max_size=1, timeout=5, server_settings={})
    async with pool.acquire() as conn:
        pid = conn.get_server_pid()
        ended = conn
    killer = await asyncpg.connect(dsn)
    assert await killer.fetchval("SELECT pg_terminate_backend($1)", pid)
    await killer.close()
    async with asyncio.timeout(5):
        while not ended.is_closed():  # until the socket's end reaches the connection
            await asyncio.sleep(0.005)
    async with pool.acquire() as conn:
        assert conn.get_server_pid() != pid
        assert await conn.fetchval("SELECT 1") == 1
    await pool.close()


async def test_the_bound_holds_and_a_waiter_gets_the_next_connection_back(dsn: str) -> None:
    pool = LeanPool(dsn, max_size=2, timeout=5, server_settings={})
    busy = 0
    most = 0

    async def use() -> None:
        nonlocal busy, most
        async with pool.acquire() as conn:
            busy += 1
            most = max(most, busy)
            await conn.fetchval("SELECT pg_sleep(0.02)")
            busy -= 1

    await asyncio.gather(*[use() for _ in range(12)])
    assert most == 2
    pids = set()
    for _ in range(4):
        async with pool.acquire() as conn:
            pids.add(conn.get_server_pid())
    assert len(pids) == 1  # idle connections are reused, not remade
    await pool.close()


async def test_a_waiter_waits_no_longer_than_the_timeout(dsn: str) -> None:
    pool = LeanPool(dsn, max_size=1, timeout=0.3, server_settings={})
    async with pool.acquire():
        started = asyncio.get_running_loop().time()
        with pytest.raises(TimeoutError):
            async with pool.acquire():
                pass
        assert asyncio.get_running_loop().time() - started < 1
    async with pool.acquire() as conn:  # the timed-out waiter left nothing behind
        assert await conn.fetchval("SELECT 1") == 1
    await pool.close()
    with pytest.raises(asyncpg.InterfaceError):
        async with pool.acquire():
            pass


async def test_an_unreachable_server_fails_within_the_timeout() -> None:
    pool = LeanPool("postgresql://postgres@127.0.0.1:1/none", max_size=1, timeout=0.5, server_settings={})
    for _ in range(2):  # the failed connect gave its place back
        with pytest.raises(OSError):
            async with pool.acquire():
                pass
    await pool.close()


async def test_arrays_bind_as_asyncpg_publishes_it(dsn: str) -> None:
    pool = LeanPool(dsn, max_size=1, timeout=5, server_settings={})
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT cardinality($1::bytea[])", [b"a", b"", b"\x00c"]) == 3
        assert await conn.fetchval("SELECT $1::varchar[]", ("x", None)) == ["x", None]
        assert await conn.fetchval("SELECT array_ndims($1::integer[])", [[1, 2], [3, 4]]) == 2
        assert await conn.fetchval("SELECT $1::bigint[]", []) == []
        assert await conn.fetchval("SELECT cardinality($1::integer[])", {1, 2}) == 2  # any sized iterable
        # a string or a dict is no array
        for refused in ("ab", {"a": 1}):
            with pytest.raises(asyncpg.DataError, match="sized iterable container expected"):
                await conn.fetchval("SELECT $1::integer[]", refused)
    await pool.close()


async def test_leases_and_commits_share_one_bound_each_on_its_setting(dsn: str) -> None:
    pool = LeanPool(dsn, max_size=2, timeout=5, server_settings={})
    async with pool.acquire(durable=False) as lease, pool.acquire() as commit:
        assert await lease.fetchval("SHOW synchronous_commit") == "off"
        assert await commit.fetchval("SHOW synchronous_commit") == "on"  # the server's own
        pids = {lease.get_server_pid(), commit.get_server_pid()}
    async with pool.acquire(durable=False) as lease:
        assert lease.get_server_pid() in pids
        assert await lease.fetchval("SHOW synchronous_commit") == "off"
    busy = 0
    most = 0

    async def use(durable: bool) -> None:
        nonlocal busy, most
        async with pool.acquire(durable=durable) as conn:
            busy += 1
            most = max(most, busy)
            expected = "on" if durable else "off"
            assert await conn.fetchval("SELECT current_setting('synchronous_commit'), pg_sleep(0.01)") == expected
            busy -= 1

    # Commits alone, then leases alone: the idle connections of the other kind are switched, never added to.
    await asyncio.gather(*[use(True) for _ in range(6)])
    await asyncio.gather(*[use(False) for _ in range(6)])
    await asyncio.gather(*[use(n % 3 == 0) for _ in range(2) for n in range(9)])
    assert most == 2
    async with pool.acquire() as conn:
        assert conn.get_server_pid() in pids  # the same two connections throughout
    await pool.close()


async def test_a_connection_that_cannot_be_switched_gives_its_place_back(dsn: str) -> None:
    pool = LeanPool(dsn, max_size=1, timeout=5, server_settings={})
    async with pool.acquire() as conn:
        pid = conn.get_server_pid()
    killer = await asyncpg.connect(dsn)
    assert await killer.fetchval("SELECT pg_terminate_backend($1)", pid)
    await killer.close()
    # Switched to a lease's setting before the socket's end reached it, the switch fails and takes the connection
    # with it, however asyncpg words the lost connection; if the end came first, the pool saw it closed and made a new
    # one.
    with contextlib.suppress(Exception):
        async with pool.acquire(durable=False):
            pass
    async with pool.acquire(durable=False) as conn:  # its place was given back: a new one is made in it
        assert conn.get_server_pid() != pid
        assert await conn.fetchval("SHOW synchronous_commit") == "off"
    await pool.close()
