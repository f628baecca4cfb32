"""The whole bill of a turn: the CPU of statestore's process, of every PostgreSQL process and of redis-server,
read from /proc (`se.sum_exec_runtime` of every thread, nanoseconds) before and after a batch of turns.

The database's and Redis's processes also work for nobody in particular (the checkpointer, the WAL writer,
autovacuum, Redis's cron): their rate is measured over a quiet spell before the run and subtracted from each batch
for its duration, and what remains is charged to the batch's turns. Anything else on the same PostgreSQL or Redis
lands on the bill too, so the benches bill services of their own (bench/throwaway.py). PostgreSQL's processes are
found from its data directory's postmaster.pid (so the bench must run where the server runs, as root or as its
owner), Redis's from `INFO server`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import redis

from bench.procs import children, sched_ns_by_thread


@dataclass(frozen=True, slots=True)
class Reading:
    at: float  # monotonic seconds
    statestore_ns: int
    postgres_ns: int
    redis_ns: int


@dataclass(frozen=True, slots=True)
class Bill:
    """CPU per turn, in microseconds."""

    statestore_us: float
    postgres_us: float
    redis_us: float

    @property
    def total_us(self) -> float:
        return self.statestore_us + self.postgres_us + self.redis_us

    def as_dict(self) -> dict[str, float]:
        return {
            "statestore_us": self.statestore_us,
            "postgres_us": self.postgres_us,
            "redis_us": self.redis_us,
            "total_us": self.total_us,
        }


def _cpu_ns(pids: Sequence[int]) -> int:
    return sum(sum(sched_ns_by_thread(pid).values()) for pid in pids)


def postmaster_pid(admin_dsn: str) -> int:
    async def data_directory() -> str:
        connection = await asyncpg.connect(admin_dsn)
        try:
            return str(await connection.fetchval("SHOW data_directory"))
        finally:
            await connection.close()

    pid_file = Path(asyncio.run(data_directory())) / "postmaster.pid"
    return int(pid_file.read_text().split("\n", 1)[0])


def redis_pid(url: str) -> int:
    client = redis.Redis.from_url(url)
    try:
        return int(client.info("server")["process_id"])
    finally:
        client.close()


class Meter:
    """Reads the three bills; `idle` measures what PostgreSQL and Redis spend with no turn running."""

    def __init__(self, statestore_pids: Sequence[int], admin_dsn: str, redis_url: str) -> None:
        self.statestore_pids = list(statestore_pids)
        self.postmaster = postmaster_pid(admin_dsn)
        self.redis = redis_pid(redis_url)
        self.idle_postgres_ns_per_s = 0.0
        self.idle_redis_ns_per_s = 0.0

    def read(self) -> Reading:
        # Backends come and go: the postmaster's children are listed afresh each time (statestore's pooled
        # connections stay for the run, so their CPU is not lost with an exited backend).
        postgres = [self.postmaster, *children(self.postmaster)]
        return Reading(time.monotonic(), _cpu_ns(self.statestore_pids), _cpu_ns(postgres), _cpu_ns([self.redis]))

    def idle(self, seconds: float = 3.0) -> None:
        before = self.read()
        time.sleep(seconds)
        after = self.read()
        elapsed = after.at - before.at
        self.idle_postgres_ns_per_s = (after.postgres_ns - before.postgres_ns) / elapsed
        self.idle_redis_ns_per_s = (after.redis_ns - before.redis_ns) / elapsed

    def bill(self, before: Reading, after: Reading, turns: int) -> Bill:
        """What `turns` turns between two readings cost, the idle rates taken off."""
        elapsed = after.at - before.at
        postgres = after.postgres_ns - before.postgres_ns - self.idle_postgres_ns_per_s * elapsed
        redis_ns = after.redis_ns - before.redis_ns - self.idle_redis_ns_per_s * elapsed
        return Bill(
            (after.statestore_ns - before.statestore_ns) / turns / 1000,
            max(postgres, 0.0) / turns / 1000,
            max(redis_ns, 0.0) / turns / 1000,
        )


def add(bills: Sequence[Bill]) -> Bill:
    """The bill of several batches of the same arm (each already per turn): their mean."""
    n = len(bills)
    return Bill(
        sum(b.statestore_us for b in bills) / n,
        sum(b.postgres_us for b in bills) / n,
        sum(b.redis_us for b in bills) / n,
    )
