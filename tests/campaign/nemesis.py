"""The nemesis: faults at random moments, one at a time, each held for a random while and then undone. Every choice
comes from one seeded generator, so a seed replays the same schedule of faults (the moments the clients meet them
vary with timing).

Faults: SIGKILL of a statestore replica (restarted on the same port), PostgreSQL stopped as by a crash
(`pg_ctl -m immediate`) or hung (SIGSTOP of every process of its cluster), Redis flushed, killed or hung, and on each
path to PostgreSQL, Redis and the backend the proxy's latency, stall, bandwidth cap, reset and dropped connections and
refused connects, and a commit carried out whose answer is lost. Backend errors, stalls and cut replies are met by
single turns (tests/campaign/workload.py).

Beside it, the commit nemesis (`CommitNemesis`, a generator of its own) aims at the keyed writes
(tests/campaign/keyed.py): a keyed Response's commit carried out and its acknowledgement lost on the way to its
replica, which settles it (`lost-commit`), or which is SIGKILLed at that very moment, so that only the client's retry
under its key, on another replica, can tell (`lost-commit-kill`). A replica one fault holds down is left alone by the
other."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable

from tests.campaign.cluster import Cluster
from tests.campaign.commit_loss import commit_lost, disarm, lose_commit
from tests.campaign.history import History
from tests.campaign.keyed import MARKER
from tests.reliability.support import ServerProcess

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
        return await kill_replica(self.cluster, self.rng.choice(self.cluster.replicas), hold)

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


async def kill_replica(cluster: Cluster, replica: ServerProcess, hold: float) -> dict[str, object]:
    """SIGKILL `replica`, keep it down for `hold` seconds, start it again; nothing if another fault holds it down."""
    if replica.port in cluster.held:
        return {"port": replica.port, "skipped": True}
    cluster.held.add(replica.port)
    try:
        await asyncio.to_thread(replica.kill)
        await asyncio.sleep(hold)
        return await _restart(replica)
    finally:
        cluster.held.discard(replica.port)


async def _restart(replica: ServerProcess) -> dict[str, object]:
    try:
        await asyncio.to_thread(replica.start)
    except RuntimeError:
        return {"port": replica.port, "restarted": False}  # healing starts it again
    return {"port": replica.port}


# How long a lost-commit fault waits for a keyed Response to commit through the proxy it armed.
ARMED_FOR = 3.0


class CommitNemesis:
    """Faults for the keyed writes, one at a time, from a generator seeded apart from the nemesis's."""

    def __init__(self, cluster: Cluster, history: History, seed: int, *, mean_gap: float, mean_hold: float) -> None:
        self.cluster = cluster
        self.history = history
        self.rng = random.Random(seed + 7919)
        self.mean_gap = mean_gap
        self.mean_hold = mean_hold
        self.faults: list[tuple[str, Callable[[float], Awaitable[dict[str, object]]]]] = [
            ("lost-commit", self.lost_commit),
            ("lost-commit-kill", self.lost_commit_kill),
        ]
        self.stop = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        self.stop = stop
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

    async def _armed(self, proxy_index: int | None, then: Callable[[], None] | None) -> bool:
        """Arm a lost commit for the next keyed Response (its metadata.user_id, stored in clear, carries MARKER),
        committed by a statement of its own, on one replica's proxy or the shared one; whether one was hit."""
        proxy = self.cluster.proxies["postgres"] if proxy_index is None else self.cluster.replica_pg[proxy_index]
        lose_commit(proxy, MARKER, alone=True, then=then)
        deadline = time.monotonic() + ARMED_FOR
        while not commit_lost(proxy) and time.monotonic() < deadline and not self.stop.is_set():
            await asyncio.sleep(0.05)
        hit = commit_lost(proxy)
        # Hit: the acknowledgement is withheld (and `then` run) when PostgreSQL answers the commit, a moment later.
        while hit and proxy.faults.on_commit_lost is not None and time.monotonic() < deadline + 2:
            await asyncio.sleep(0.02)
        disarm(proxy)
        return hit

    async def lost_commit(self, hold: float) -> dict[str, object]:
        """A keyed Response's commit carried out, its acknowledgement lost: the replica settles it (fence, look)."""
        return {"hit": await self._armed(None, None)}

    async def lost_commit_kill(self, hold: float) -> dict[str, object]:
        """A keyed Response's commit carried out, its acknowledgement lost, and its replica SIGKILLed that moment:
        its client hears nothing, and retries under its key."""
        index = self.rng.randrange(len(self.cluster.replicas))
        replica = self.cluster.replicas[index]
        if replica.port in self.cluster.held or replica.process is None or replica.process.poll() is not None:
            return {"port": replica.port, "skipped": True}
        self.cluster.held.add(replica.port)
        try:
            pid = replica.pid

            def kill() -> None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

            if not await self._armed(index, kill):
                return {"port": replica.port, "hit": False}
            await asyncio.to_thread(replica.kill)  # reaps it
            await asyncio.sleep(hold)
            return {**await _restart(replica), "hit": True}
        finally:
            self.cluster.held.discard(replica.port)
