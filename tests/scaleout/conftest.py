"""Scale-out fixtures: three statestore replicas on one PostgreSQL database, behind a real HAProxy (round robin, no
stickiness), sharing a Redis Cluster of three masters started from redis-server binaries. All on 127.0.0.1, on free
ports, torn down by the fixtures.

- ``redis_cluster`` (module): the cluster; tests give each fleet its own key prefix.
- ``redis_cluster_with_replica`` (function): a cluster of the test's own whose second master has a replica.
- ``scaleout_backend`` (module): the scriptable fake backend (tests/support/fake_backend.py) every replica uses.
- ``backend`` (function): the same, with its script and recorded requests cleared.
- ``start_fleet`` (function): ``start_fleet(graceful_timeout=..., **STATESTORE_env)`` -> Fleet on the test's own
  migrated ``fresh_pg_url`` database, stopped after the test; ``fleet_factory`` does the same for a fixture of wider
  scope, on a database it is given.
- ``query(url, sql)`` reads a test database directly.
"""

from __future__ import annotations

import asyncio
import functools
import secrets
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import Row, text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from statestore.store.migrate import upgrade
from tests.scaleout.processes import (
    HAPROXY_INSTALL_HINT,
    HAProxy,
    RedisClusterProcesses,
    Replica,
    replica_env,
    require_binary,
    start_replicas,
)
from tests.support.fake_backend import FakeBackend

REPLICAS = 3


@dataclass
class Fleet:
    replicas: list[Replica]
    haproxy: HAProxy
    database_url: str
    redis_prefix: str

    @property
    def url(self) -> str:
        return self.haproxy.url

    def replica(self, name: str) -> Replica:
        return next(replica for replica in self.replicas if replica.name == name)

    def logs(self) -> str:
        """Every process's log, for assertion messages."""
        parts = [f"--- {r.name} (port {r.port})\n{r.log()[-4000:]}" for r in self.replicas]
        parts.append("--- haproxy\n" + "\n".join(list(self.haproxy.log_lines())[-60:]))
        return "\n".join(parts)


StartFleet = Callable[..., Fleet]


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcesses]:
    with RedisClusterProcesses(tmp_path_factory.mktemp("redis-cluster")) as cluster:
        yield cluster


@pytest.fixture
def redis_cluster_with_replica(tmp_path: Path) -> Iterator[RedisClusterProcesses]:
    """Three masters, the second with a replica (the last node): a cluster of a test's own, to kill a master in."""
    with RedisClusterProcesses(tmp_path / "redis-cluster", replica_of=1) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def scaleout_backend() -> Iterator[FakeBackend]:
    with FakeBackend() as fake:
        yield fake


@pytest.fixture
def backend(scaleout_backend: FakeBackend) -> FakeBackend:
    scaleout_backend.reset()
    return scaleout_backend


def migrate(database_url: str) -> str:
    upgrade(database_url)
    return database_url


@contextmanager
def fleet_factory(cluster: RedisClusterProcesses, backend: FakeBackend, workdir: Path) -> Iterator[StartFleet]:
    """Yields ``start(database_url, *, graceful_timeout=10, **STATESTORE_env)`` -> Fleet; stops every fleet it
    started on exit. The database must be migrated already (``migrate(fresh_pg_url)``)."""
    require_binary("haproxy", HAPROXY_INSTALL_HINT)
    with ExitStack() as stack:

        def start(database_url: str, *, graceful_timeout: int = 10, **env: str) -> Fleet:
            fleet_dir = workdir / f"fleet-{secrets.token_hex(3)}"
            fleet_dir.mkdir()
            prefix = f"sstest:{secrets.token_hex(6)}:"
            settings = replica_env(
                database_url=database_url,
                redis_url=cluster.url,
                redis_prefix=prefix,
                upstream_url=backend.url,
                **env,
            )
            replicas = start_replicas(REPLICAS, settings, fleet_dir, graceful_timeout)
            for replica in replicas:
                stack.callback(replica.stop)
            haproxy = stack.enter_context(HAProxy(fleet_dir, replicas))
            return Fleet(replicas, haproxy, database_url, prefix)

        yield start


@pytest.fixture
def start_fleet(
    redis_cluster: RedisClusterProcesses, scaleout_backend: FakeBackend, fresh_pg_url: str, tmp_path: Path
) -> Iterator[StartFleet]:
    """``start_fleet(graceful_timeout=10, **STATESTORE_env)`` -> Fleet on this test's own database (``fresh_pg_url``,
    migrated here), stopped before the database is dropped."""
    migrate(fresh_pg_url)
    with fleet_factory(redis_cluster, scaleout_backend, tmp_path) as start:
        yield functools.partial(start, fresh_pg_url)


def query(database_url: str, sql: str, **params: object) -> list[Row[tuple[object, ...]]]:
    """Run one SQL query on a test database, outside statestore (for what the API does not show, such as leases)."""

    async def run() -> list[Row[tuple[object, ...]]]:
        engine = create_async_engine(database_url, poolclass=NullPool)
        try:
            async with engine.connect() as connection:
                return list(await connection.execute(text(sql), params))
        finally:
            await engine.dispose()

    return asyncio.run(run())
