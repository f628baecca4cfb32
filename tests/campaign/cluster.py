"""The system under test of a campaign: a PostgreSQL cluster and a redis-server of its own (which may be crashed,
hung or flushed), the fake backend, a fault proxy on each of the three paths, statestore replicas on those proxies,
and a balancer in front of the replicas. Everything on 127.0.0.1, on free ports, removed on exit."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from statestore.store.keystore import create_keystore
from statestore.store.migrate import upgrade
from tests.campaign.commit_loss import through
from tests.campaign.network import Balancer, FaultProxy, NetworkLoop
from tests.reliability.proof_support import ADMIN_TOKEN
from tests.reliability.support import PrivatePostgres, PrivateRedis, ServerProcess, query, wait_for
from tests.support.fake_backend import FakeBackend

# Short waits everywhere, so a fault turns into an error in seconds and a dead replica's lease runs out soon.
REPLICA_SETTINGS = {
    "STATESTORE_ADMIN_TOKENS": f"root:{ADMIN_TOKEN}",
    "STATESTORE_DATABASE_TIMEOUT_SECONDS": "2",
    "STATESTORE_DATABASE_POOL_SIZE": "8",
    "STATESTORE_UPSTREAM_CONNECT_TIMEOUT": "2",
    "STATESTORE_UPSTREAM_READ_TIMEOUT": "6",
    "STATESTORE_LEASE_SECONDS": "4",
    "STATESTORE_BACKGROUND_POLL_SECONDS": "0.5",
    "STATESTORE_DEFAULT_TTL_SECONDS": "7200",
    "STATESTORE_LOG_LEVEL": "WARNING",
}


@dataclass
class Cluster:
    pg: PrivatePostgres
    redis: PrivateRedis
    backend: FakeBackend
    network: NetworkLoop
    proxies: dict[str, FaultProxy]
    replicas: list[ServerProcess]
    balancer: Balancer
    # Each replica's own proxy to PostgreSQL, in front of the shared one: a commit's acknowledgement lost on the way
    # to one replica (tests/campaign/commit_loss.py), which the nemesis may then kill.
    replica_pg: list[FaultProxy]
    database_url: str
    settings: dict[str, str] = field(default_factory=dict)  # what every replica runs with
    paused_pg: list[int] = field(default_factory=list)
    held: set[int] = field(default_factory=set)  # the ports of replicas a fault holds down now

    @property
    def url(self) -> str:
        return self.balancer.url

    def replica_ports(self) -> list[int]:
        return [replica.port for replica in self.replicas]

    def heal(self) -> None:
        """Undo every fault still in force: clear the proxies, wake and start what was paused or stopped."""
        for proxy in (*self.proxies.values(), *self.replica_pg):
            proxy.faults.clear()
        if self.paused_pg:
            self.pg.resume(self.paused_pg)
            self.paused_pg = []
        assert self.redis.process is not None
        if self.redis.process.poll() is None:
            self.redis.resume()
        else:
            self.redis.start()
        if not (self.pg.data / "postmaster.pid").exists():
            self.pg.start()
        for replica in self.replicas:
            if replica.process is None or replica.process.poll() is not None:
                replica.start()
        with httpx.Client(timeout=2) as http:
            for replica in self.replicas:
                ready = functools.partial(_ready, http, replica.url)
                wait_for(ready, within=60, what=f"replica on {replica.port} ready")
        # An erasure whose replica was killed is taken up by another once its lease runs out, and may delete threads
        # a heal has just listed: healed is when none is left running.
        running = "SELECT id FROM erasures WHERE status = 'running' LIMIT 1"
        wait_for(lambda: not query(self.database_url, running), within=90, interval=0.5, what="every erasure finished")

    def logs(self) -> str:
        return "\n".join(f"--- replica {r.port}\n{r.log()[-3000:]}" for r in self.replicas)


def _ready(http: httpx.Client, url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return http.get(url + "/readyz").status_code == 200
    return False


# A master key ring for clusters run with encryption at rest (docs/encryption.md): fixed, so a test can
# start another process on the same data.
ENCRYPTION_KEYS = "c1:" + base64.urlsafe_b64encode(bytes(range(32))).decode().rstrip("=")


@contextmanager
def running_cluster(
    *,
    replicas: int = 3,
    redis_prefix: str = "ss:",
    encryption: bool = False,
    keystore_database: str | None = None,
    extra_settings: dict[str, str] | None = None,
) -> Iterator[Cluster]:
    """`encryption`: the replicas seal content under ENCRYPTION_KEYS; `keystore_database`: their data keys in a
    database of that name on the same PostgreSQL (made here) instead of the content database."""
    with ExitStack() as stack:
        pg = PrivatePostgres()
        stack.callback(pg.remove)
        pg.start()
        upgrade(pg.url)
        settings = {**REPLICA_SETTINGS, **(extra_settings or {})}
        if encryption:
            settings["STATESTORE_ENCRYPTION_KEYS"] = ENCRYPTION_KEYS
            # An erasure waits for every replica to forget the keys it destroyed: short here, within a client's timeout.
            settings["STATESTORE_DATA_KEY_CACHE_SECONDS"] = "1"
        redis = PrivateRedis()
        stack.callback(redis.stop)
        redis.start()
        backend = stack.enter_context(FakeBackend())
        network = NetworkLoop()
        stack.callback(network.stop)
        backend_port = urlsplit(backend.url).port
        assert backend_port is not None
        proxies = {
            "postgres": FaultProxy(network, "postgres", pg.port),
            "redis": FaultProxy(network, "redis", redis.port),
            "backend": FaultProxy(network, "backend", backend_port),
        }
        for proxy in proxies.values():
            stack.callback(proxy.close)
        if keystore_database is not None:
            keystore_url = pg.url.rsplit("/", 1)[0] + "/" + keystore_database
            pg.create_database(keystore_database)
            asyncio.run(create_keystore(keystore_url))
            settings["STATESTORE_KEYSTORE_URL"] = through(keystore_url, proxies["postgres"].port)
        replica_pg: list[FaultProxy] = []
        for index in range(replicas):
            own = FaultProxy(network, f"postgres-{index}", proxies["postgres"].port)
            stack.callback(own.close)
            replica_pg.append(own)

        def replica(own: FaultProxy) -> ServerProcess:
            return ServerProcess(
                database_url=through(pg.url, own.port),
                upstream_url=f"http://127.0.0.1:{proxies['backend'].port}",
                redis_url=through(redis.url, proxies["redis"].port),
                redis_prefix=redis_prefix,
                # The Responses door (background responses) on the same backend, through the same proxy.
                env={**settings, "STATESTORE_CHAT_UPSTREAM_URL": f"http://127.0.0.1:{proxies['backend'].port}"},
            )

        # The replicas start side by side: each start is mostly a process importing its modules and waiting.
        with ThreadPoolExecutor(replicas) as pool:
            starting = [pool.submit(replica, own) for own in replica_pg]
        processes = [future.result() for future in starting if future.exception() is None]
        for process in processes:
            stack.callback(process.stop)
        for future in starting:
            future.result()  # the first replica that did not start, once the others are in the stack
        balancer = Balancer(network, lambda: [p.port for p in processes])
        stack.callback(balancer.close)
        yield Cluster(pg, redis, backend, network, proxies, processes, balancer, replica_pg, pg.url, settings)


async def read_after_heal(
    http: httpx.AsyncClient, url: str, params: dict[str, int] | dict[str, str] | None = None
) -> httpx.Response:
    """A GET of the final state, sent again when its connection breaks (a keep-alive connection through the balancer
    to a replica the faults killed is found dead only when it is next used, and httpx does not resend on it) or when
    it is answered 503 (on a loaded machine, a read of a thousand threads may outlast the campaign's 2 s database
    timeout while the replicas' pools replace the connections the faults broke); a 503 still there the fifth time is
    the verdict."""
    for attempt in range(5):
        try:
            reply = await http.get(url, params=params)
        except httpx.TransportError:
            if attempt == 4:
                raise
        else:
            if reply.status_code != 503 or attempt == 4:
                return reply
        await asyncio.sleep(1.0)
    raise AssertionError("unreachable")
