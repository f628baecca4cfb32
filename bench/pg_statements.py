"""PostgreSQL's share of a turn, statement by statement: calls, execution time, rows, buffers and WAL bytes per turn
of a threaded continue, a Responses continue from the chain's head and a branch (a regenerate below the head of a
chain `--depth` deep), read from `pg_stat_statements`.

    .venv/bin/python -m bench.pg_statements                     # 200 turns an arm
    .venv/bin/python -m bench.pg_statements --turns 20          # a smoke run

The bench starts a throwaway cluster of its own (initdb and pg_ctl from STATESTORE_BENCH_PG_BIN, by default
/usr/lib/postgresql/15/bin, under $TMPDIR, with `shared_preload_libraries = pg_stat_statements`), so the counters
are statestore's alone; Redis is the machine's (STATESTORE_BENCH_REDIS). Run as root, the cluster runs as the
`postgres` user. Arms run one after the other, the counters reset before each; every arm's figures are per turn.
`wal` is the WAL the statement wrote; `blks` the shared buffers it touched (hit + read). Prints a table and writes
JSON to $TMPDIR.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import orjson

from bench.harness import DEFAULT_REDIS, _statestore_env, redis_prefix
from bench.procs import Service, free_port, python
from bench.responses_arm import Arms, DeepChain, history

DEFAULT_BIN = "/usr/lib/postgresql/15/bin"

_STATEMENTS = """
SELECT queryid, query, calls, total_exec_time, rows, shared_blks_hit + shared_blks_read AS blks, wal_bytes,
    wal_records
FROM pg_stat_statements
WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
ORDER BY total_exec_time DESC
"""


def _as_owner(argv: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: the cluster then runs as `postgres`."""
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv


@contextlib.contextmanager
def throwaway_cluster(bin_dir: Path, work: Path) -> Iterator[str]:
    """A PostgreSQL cluster of the bench's own, with pg_stat_statements, and its admin DSN; stopped and removed at
    the end."""
    data = work / "pgdata"
    data.mkdir()
    if os.geteuid() == 0:
        owner = pwd.getpwnam("postgres")
        os.chown(work, owner.pw_uid, owner.pw_gid)
        os.chown(data, owner.pw_uid, owner.pw_gid)
    user = "postgres" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
    subprocess.run(
        _as_owner([str(bin_dir / "initdb"), "-D", str(data), "-U", user, "--auth=trust", "-E", "UTF8"]),
        check=True,
        stdout=subprocess.DEVNULL,
    )
    port = free_port()
    settings = {
        "port": str(port),
        "listen_addresses": "'127.0.0.1'",
        "unix_socket_directories": f"'{work}'",
        "shared_preload_libraries": "'pg_stat_statements'",
        "pg_stat_statements.track": "all",
        "pg_stat_statements.track_utility": "off",
        "track_io_timing": "on",
    }
    with (data / "postgresql.conf").open("a") as conf:
        conf.writelines(f"{name} = {value}\n" for name, value in settings.items())
    ctl = str(bin_dir / "pg_ctl")
    subprocess.run(
        _as_owner([ctl, "-D", str(data), "-l", str(work / "postgres.log"), "-w", "start"]),
        check=True,
        stdout=subprocess.DEVNULL,
    )
    try:
        yield f"postgresql://{user}@127.0.0.1:{port}/postgres"
    finally:
        stop = _as_owner([ctl, "-D", str(data), "-m", "fast", "-w", "stop"])
        subprocess.run(stop, check=False, stdout=subprocess.DEVNULL)  # the data goes either way
        shutil.rmtree(data, ignore_errors=True)


async def _admin(dsn: str, sql: str) -> None:
    connection = await asyncpg.connect(dsn)
    try:
        await connection.execute(sql)
    finally:
        await connection.close()


async def measure(
    statestore: str, backend: str, database_dsn: str, *, turns: int, depth: int
) -> dict[str, list[dict[str, Any]]]:
    """Each arm's statements, per turn."""
    results: dict[str, list[dict[str, Any]]] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        arms = Arms(http, statestore, backend, history(8 * 1024))
        await arms.setup()
        chain = DeepChain(arms, depth)
        await chain.setup()
        order: dict[str, Callable[[], Awaitable[float]]] = {
            "thread continue": arms.thread,
            "response continue": arms.response,
            f"branch@{depth}": chain.regenerate,
        }
        stats = await asyncpg.connect(database_dsn)
        try:
            for name, arm in order.items():
                for _ in range(3):  # warm: prepared statements, caches
                    await arm()
                await stats.execute("SELECT pg_stat_statements_reset()")
                for _ in range(turns):
                    await arm()
                rows = await stats.fetch(_STATEMENTS)
                results[name] = [
                    {
                        "query": " ".join(str(row["query"]).split())[:160],
                        "calls": row["calls"] / turns,
                        "ms": row["total_exec_time"] / turns,
                        "rows": row["rows"] / turns,
                        "blks": row["blks"] / turns,
                        "wal_bytes": float(row["wal_bytes"]) / turns,
                    }
                    for row in rows
                    if "pg_stat_statements" not in row["query"]
                ]
        finally:
            await stats.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.pg_statements", description=__doc__)
    parser.add_argument("--turns", type=int, default=200, help="turns an arm (default 200)")
    parser.add_argument("--depth", type=int, default=200, help="the branch arm's chain depth (default 200)")
    args = parser.parse_args()
    bin_dir = Path(os.environ.get("STATESTORE_BENCH_PG_BIN", DEFAULT_BIN))
    redis_url = os.environ.get("STATESTORE_BENCH_REDIS", DEFAULT_REDIS)
    work = Path(tempfile.mkdtemp(prefix="statestore-bench-pgstat-"))
    backend_port, statestore_port = free_port(), free_port()
    backend_url, statestore_url = f"http://127.0.0.1:{backend_port}", f"http://127.0.0.1:{statestore_port}"
    with throwaway_cluster(bin_dir, work) as admin_dsn, redis_prefix(redis_url) as prefix:
        base, _, _ = admin_dsn.rpartition("/")
        database = f"{base}/statestore"
        asyncio.run(_admin(admin_dsn, "CREATE DATABASE statestore"))
        asyncio.run(_admin(database, "CREATE EXTENSION pg_stat_statements"))
        env = _statestore_env(database, redis_url, prefix, backend_url, "WARNING")
        env["STATESTORE_CHAT_UPSTREAM_URL"] = backend_url
        backend = Service(
            "backend", [python(), "-m", "bench.backend", "--port", str(backend_port)], env=env, log_dir=work,
            health_url=backend_url + "/v1/models",
        )  # fmt: skip
        server: Service | None = None
        try:
            migrate = Service(
                "migrate", [python(), "-m", "statestore.cli", "migrate"], env=env, log_dir=work, health_url=""
            )
            if migrate.process.wait(timeout=120) != 0:
                raise RuntimeError(f"migrate failed:\n{migrate.log_tail()}")
            migrate.stop()
            server = Service(
                "statestore", [python(), "-m", "statestore.cli", "serve", "--port", str(statestore_port)], env=env,
                log_dir=work, health_url=statestore_url + "/healthz",
            )  # fmt: skip
            backend.wait_healthy()
            server.wait_healthy()
            results = asyncio.run(measure(statestore_url, backend_url, database, turns=args.turns, depth=args.depth))
        finally:
            if server is not None:
                server.stop()
            backend.stop()
    (work / "results.json").write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    for arm, statements in results.items():
        total = {key: sum(s[key] for s in statements) for key in ("calls", "ms", "rows", "blks", "wal_bytes")}
        print(f"\n{arm} (per turn)")
        print(f"{'calls':>6} {'ms':>8} {'rows':>8} {'blks':>8} {'wal B':>8}  statement")
        for s in [*statements, {**total, "query": "(total)"}]:
            print(
                f"{s['calls']:>6.2f} {s['ms']:>8.3f} {s['rows']:>8.1f} {s['blks']:>8.1f} {s['wal_bytes']:>8.0f}  "
                f"{s['query']}"
            )
    print(f"results: {work / 'results.json'}")


if __name__ == "__main__":
    main()
