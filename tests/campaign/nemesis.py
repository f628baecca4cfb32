"""The nemesis: faults at random moments, one at a time, each held for a random while and then undone. Every choice
comes from one seeded generator, so a seed replays the same schedule of faults (the moments the clients meet them
vary with timing).

Faults: SIGKILL of a statestore replica (restarted on the same port), PostgreSQL stopped as by a crash
(`pg_ctl -m immediate`) or hung (SIGSTOP of every process of its cluster), Redis flushed, killed or hung, and on each
path to PostgreSQL, Redis and the backend the proxy's latency, stall, bandwidth cap, reset and dropped connections and
refused connects, and a commit carried out whose answer is lost. Backend errors, stalls and cut replies are met by
single turns (tests/campaign/workload.py)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable

from tests.campaign.cluster import Cluster
from tests.campaign.history import History

PATHS = ("postgres", "redis", "backend")


class Nemesis:
    def __init__(self, cluster: Cluster, history: History, seed: int, *, mean_gap: float, mean_hold: float) -> None:
        self.cluster = cluster
        self.history = history
        self.rng = random.Random(seed)
        self.mean_gap = mean_gap
        self.mean_hold = mean_hold
        self.faults: list[tuple[str, Callable[[float], Awaitable[dict[str, object]]]]] = [
            ("kill-replica", self.kill_replica),
            ("postgres-crash", self.postgres_crash),
            ("postgres-hang", self.postgres_hang),
            ("postgres-lost-reply", self.postgres_lost_reply),
            ("redis-flushall", self.redis_flushall),
            ("redis-kill", self.redis_kill),
            ("redis-hang", self.redis_hang),
            *((f"{path}-{kind}", self._network(path, kind)) for path in PATHS for kind in NETWORK_FAULTS),
        ]

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            gap = self.rng.expovariate(1 / self.mean_gap)
            name, fault = self.rng.choice(self.faults)
            hold = min(self.rng.expovariate(1 / self.mean_hold), 4 * self.mean_hold)
            try:
                await asyncio.wait_for(stop.wait(), gap)
                return
            except TimeoutError:
                pass
            at = self.history.now()
            details = await fault(hold)
            self.history.fault(name, at, hold=round(hold, 2), **details)

    async def kill_replica(self, hold: float) -> dict[str, object]:
        replica = self.rng.choice(self.cluster.replicas)
        await asyncio.to_thread(replica.kill)
        await asyncio.sleep(hold)
        try:
            await asyncio.to_thread(replica.start)
        except RuntimeError:
            return {"port": replica.port, "restarted": False}  # healing starts it again
        return {"port": replica.port}

    async def postgres_crash(self, hold: float) -> dict[str, object]:
        await asyncio.to_thread(self.cluster.pg.crash)
        await asyncio.sleep(hold)
        await asyncio.to_thread(self.cluster.pg.start)
        return {}

    async def postgres_hang(self, hold: float) -> dict[str, object]:
        self.cluster.paused_pg = self.cluster.pg.pause()
        await asyncio.sleep(hold)
        self.cluster.pg.resume(self.cluster.paused_pg)
        self.cluster.paused_pg = []
        return {}

    async def postgres_lost_reply(self, hold: float) -> dict[str, object]:
        """The next commit reaches PostgreSQL and is carried out, and its answer is lost with the connection."""
        proxy = self.cluster.proxies["postgres"]
        proxy.faults.lose_reply_after = b"assistant"
        await asyncio.sleep(hold)
        hit = proxy.faults.lose_reply_after is None
        proxy.faults.lose_reply_after = None
        return {"hit": hit}

    async def redis_flushall(self, hold: float) -> dict[str, object]:
        def flush() -> None:
            with self.cluster.redis.client() as client:
                client.flushall()

        await asyncio.to_thread(flush)
        return {}

    async def redis_kill(self, hold: float) -> dict[str, object]:
        await asyncio.to_thread(self.cluster.redis.kill)
        await asyncio.sleep(hold)
        await asyncio.to_thread(self.cluster.redis.start)
        return {}

    async def redis_hang(self, hold: float) -> dict[str, object]:
        self.cluster.redis.pause()
        await asyncio.sleep(hold)
        self.cluster.redis.resume()
        return {}

    def _network(self, path: str, kind: str) -> Callable[[float], Awaitable[dict[str, object]]]:
        async def fault(hold: float) -> dict[str, object]:
            proxy = self.cluster.proxies[path]
            details: dict[str, object] = {}
            if kind in ("reset", "drop"):
                details["connections"] = await asyncio.to_thread(proxy.cut, reset=kind == "reset")
                return details
            if kind == "latency":
                proxy.faults.latency = round(self.rng.uniform(0.01, 0.3), 3)
                details["seconds"] = proxy.faults.latency
            elif kind == "stall":
                proxy.faults.stalled = True
            elif kind == "bandwidth":
                proxy.faults.bytes_per_second = self.rng.choice((2_000, 20_000, 200_000))
                details["bytes_per_second"] = proxy.faults.bytes_per_second
            elif kind == "refuse":
                proxy.faults.refuse = True
            await asyncio.sleep(hold)
            proxy.faults.clear()
            return details

        return fault


NETWORK_FAULTS = ("latency", "stall", "bandwidth", "reset", "drop", "refuse")
