"""PostgreSQL's share of a turn, statement by statement: calls, execution time, rows, buffers and WAL bytes per turn
of a threaded continue, a Responses continue from the chain's head and a branch (a regenerate below the head of a
chain `--depth` deep), read from `pg_stat_statements`.

    .venv/bin/python -m bench.pg_statements                     # 200 turns an arm
    .venv/bin/python -m bench.pg_statements --turns 20          # a smoke run

The bench starts a throwaway cluster of its own (bench/throwaway.py: initdb and pg_ctl from STATESTORE_BENCH_PG_BIN,
by default /usr/lib/postgresql/15/bin, under $TMPDIR, with `shared_preload_libraries = pg_stat_statements`), so the
counters are statestore's alone; Redis is the machine's (STATESTORE_BENCH_REDIS). Run as root, the cluster runs as the
`postgres` user. Arms run one after the other, the counters reset before each; every arm's figures are per turn.
`wal` is the WAL the statement wrote; `blks` the shared buffers it touched (hit + read). Prints a table and writes
JSON to $TMPDIR.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import orjson

from bench.harness import DEFAULT_REDIS, _statestore_env, redis_prefix
from bench.procs import Service, free_port, python
from bench.responses_arm import Arms, DeepChain, history
from bench.throwaway import postgres_cluster

_STATEMENTS = """
SELECT queryid, query, calls, total_exec_time, rows, shared_blks_hit + shared_blks_read AS blks, wal_bytes,
    wal_records
FROM pg_stat_statements
WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
ORDER BY total_exec_time DESC
"""


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
    redis_url = os.environ.get("STATESTORE_BENCH_REDIS", DEFAULT_REDIS)
    work = Path(tempfile.mkdtemp(prefix="statestore-bench-pgstat-"))
    backend_port, statestore_port = free_port(), free_port()
    backend_url, statestore_url = f"http://127.0.0.1:{backend_port}", f"http://127.0.0.1:{statestore_port}"
    with postgres_cluster(work, statements=True) as admin_dsn, redis_prefix(redis_url) as prefix:
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
