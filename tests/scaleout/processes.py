"""Real processes for the scale-out tests: a Redis Cluster of three masters, statestore replicas and HAProxy.

Everything binds to 127.0.0.1 on free ports, writes its files under a temporary directory the caller owns, and is
stopped by the caller (each class is a context manager). A needed binary that is missing fails the test with the
command that installs it (`make test` installs it first, scripts/ensure-system-packages.sh): never a skip.
"""

from __future__ import annotations

import csv
import functools
import io
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import httpx
import pytest
import redis

from tests.support.server import OWNER_SECRET, REPO, free_port

HAPROXY_INSTALL_HINT = "run `make system-packages` (as root it installs haproxy with apt-get)"


def require_binary(name: str, hint: str) -> str:
    """The path of `name`; a missing binary fails the test, naming what installs it."""
    # /usr/sbin is where Debian puts haproxy, and it is not on every PATH.
    path = shutil.which(name) or shutil.which(name, path="/usr/local/sbin:/usr/sbin:/sbin")
    if path is not None:
        return path
    pytest.fail(f"`{name}` is not installed; {hint}", pytrace=False)


def wait_for(condition: str, check: Callable[[], object], timeout: float, interval: float = 0.05) -> None:
    """Poll `check()` until it returns true; fail with `condition` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with suppress(OSError, redis.RedisError, httpx.HTTPError):
            if check():
                return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {condition}")


def port_refuses(port: int) -> bool:
    """Whether a new TCP connection to 127.0.0.1:`port` is refused (nobody listens there any more)."""
    with socket.socket() as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(("127.0.0.1", port))
        except ConnectionRefusedError:
            return True
    return False


def command(client: redis.Redis, *args: str) -> Any:
    """A raw Redis command (redis-py leaves `execute_command` untyped)."""
    return client.execute_command(*args)  # type: ignore[no-untyped-call]


def _stop(process: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class _Managed:
    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


# -- Redis Cluster --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RedisNode:
    port: int
    bus_port: int
    process: subprocess.Popen[bytes]

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5.0)

    def ping(self) -> bool:
        with self.client() as client:
            return bool(command(client, "PING"))


class RedisClusterProcesses(_Managed):
    """`masters` redis-server processes with `--cluster-enabled yes`, joined by `redis-cli --cluster create`."""

    def __init__(self, workdir: Path, masters: int = 3, *, replica_of: int | None = None) -> None:
        """`replica_of`: the index of a master given a replica, the last node."""
        self._server = require_binary("redis-server", "install Redis 7 (Debian: apt-get install redis-server)")
        self._cli = require_binary("redis-cli", "install Redis 7 (Debian: apt-get install redis-tools)")
        self.workdir = workdir
        self.nodes: list[RedisNode] = []
        try:
            for _ in range(masters):
                self._start_node()
            addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
            self._cli_command("create", *addresses, "--cluster-replicas", "0", "--cluster-yes")
            if replica_of is not None:
                master = self.nodes[replica_of]
                replica = self._start_node()
                with master.client() as client:
                    master_id = command(client, "CLUSTER", "MYID").decode()
                self._cli_command(
                    "add-node", f"127.0.0.1:{replica.port}", f"127.0.0.1:{master.port}",
                    "--cluster-slave", "--cluster-master-id", master_id,
                )  # fmt: skip
                wait_for(f"the replica on {replica.port} in sync", functools.partial(self._in_sync, replica), 30)
            for node in self.nodes:
                wait_for(f"cluster_state:ok on {node.port}", functools.partial(self._state_ok, node), timeout=15)
        except BaseException:
            self.stop()
            raise

    def _start_node(self) -> RedisNode:
        port, bus_port = free_port(), free_port()
        node_dir = self.workdir / f"redis-{len(self.nodes)}"
        node_dir.mkdir(parents=True)
        log = (node_dir / "redis.log").open("wb")
        # The bus port is chosen too (Redis 7 `cluster-port`): the default port + 10000 may be taken.
        process = subprocess.Popen(
            [self._server, "--port", str(port), "--cluster-port", str(bus_port), "--bind", "127.0.0.1",
             "--cluster-enabled", "yes", "--cluster-config-file", str(node_dir / "nodes.conf"),
             "--cluster-node-timeout", "2000", "--dir", str(node_dir), "--save", "", "--appendonly", "no",
             "--protected-mode", "no"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        log.close()
        node = RedisNode(port, bus_port, process)
        self.nodes.append(node)
        wait_for(f"redis-server on {node.port}", node.ping, timeout=10)
        return node

    def _cli_command(self, *args: str) -> None:
        done = subprocess.run([self._cli, "--cluster", *args], capture_output=True, timeout=30, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster {args[0]} failed:\n{done.stdout.decode()}{done.stderr.decode()}")

    @staticmethod
    def _in_sync(node: RedisNode) -> bool:
        with node.client() as client:
            info = client.info("replication")  # parsed by redis-py
        return bool(info.get("master_link_status") == "up")

    @staticmethod
    def _state_ok(node: RedisNode) -> bool:
        with node.client() as client:
            info = command(client, "CLUSTER", "INFO")
        text = info.decode() if isinstance(info, bytes) else str(info)
        return "cluster_state:ok" in text

    @property
    def url(self) -> str:
        """The statestore URL for this cluster: any node seeds the slot map; `cluster=1` selects RedisCluster."""
        return f"redis://127.0.0.1:{self.nodes[0].port}/0?cluster=1"

    def client(self) -> redis.RedisCluster:
        return redis.RedisCluster(host="127.0.0.1", port=self.nodes[0].port, socket_timeout=5.0)

    def keyslot(self, key: str) -> int:
        """The slot of `key`, as the cluster itself computes it (CLUSTER KEYSLOT)."""
        with self.nodes[0].client() as client:
            return int(command(client, "CLUSTER", "KEYSLOT", key))

    def node_of_slot(self, slot: int) -> RedisNode:
        """The master that serves `slot`, read from CLUSTER SLOTS."""
        with self.nodes[0].client() as client:
            ranges = command(client, "CLUSTER", "SLOTS")
        for first, last, master, *_ in ranges:
            if int(first) <= slot <= int(last):
                port = int(master[1])
                return next(node for node in self.nodes if node.port == port)
        raise LookupError(f"no node serves slot {slot}")

    def stop(self) -> None:
        for node in self.nodes:
            _stop(node.process)


# -- statestore replicas --------------------------------------------------------------------------------------------


class Replica:
    """One `statestore serve` process (like tests.support.server.StatestoreServer, with the serve flags exposed and
    without waiting, so that several start in parallel)."""

    def __init__(self, name: str, env: Mapping[str, str], workdir: Path, graceful_timeout: int) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.graceful_timeout = graceful_timeout
        self.log_path = workdir / f"statestore-{name}.log"
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "statestore.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                 "--graceful-timeout", str(graceful_timeout)],
                env=dict(env),
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip

    # As long as tests/support/server.py waits: three replicas importing at once on a loaded 2-core machine are slow.
    # One client for every attempt: a new one loads the CA bundle, tens of milliseconds of CPU taken from the replicas
    # starting, twenty times a second.
    def wait_until_ready(self, timeout: float = 60.0) -> None:
        with httpx.Client(timeout=1.0) as client:

            def ready() -> bool:
                if self.process.poll() is not None:
                    raise RuntimeError(f"replica {self.name} exited with {self.process.returncode}:\n{self.log()}")
                return client.get(self.url + "/readyz").status_code == 200

            wait_for(f"replica {self.name} ready", ready, timeout=timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_lines(self) -> list[str]:
        return self.log().splitlines()

    def kill(self) -> None:
        """SIGKILL: no shutdown at all, as when a node dies or the OOM killer strikes."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def terminate(self) -> None:
        """SIGTERM: what Kubernetes and `docker stop` send; uvicorn finishes in-flight requests first."""
        self.process.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        _stop(self.process, timeout=self.graceful_timeout + 5)


def replica_env(
    *, database_url: str, redis_url: str, redis_prefix: str, upstream_url: str, **extra: str
) -> dict[str, str]:
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("STATESTORE_")},
        "STATESTORE_DATABASE_URL": database_url,
        "STATESTORE_REDIS_URL": redis_url,
        "STATESTORE_REDIS_PREFIX": redis_prefix,
        "STATESTORE_UPSTREAM_URL": upstream_url,
        "STATESTORE_OWNER_SECRET": OWNER_SECRET,
        "STATESTORE_LOG_LEVEL": "INFO",
        **extra,
    }


def start_replicas(count: int, env: Mapping[str, str], workdir: Path, graceful_timeout: int) -> list[Replica]:
    replicas = [Replica(f"r{index}", env, workdir, graceful_timeout) for index in range(count)]
    try:
        with ThreadPoolExecutor(max_workers=count) as pool:
            list(pool.map(lambda replica: replica.wait_until_ready(), replicas))
    except BaseException:
        for replica in replicas:
            replica.stop()
        raise
    return replicas


# -- HAProxy --------------------------------------------------------------------------------------------------------

REPLICA_HEADER = "x-statestore-replica"

_HAPROXY_CONFIG = """\
# Written by tests/scaleout: round robin over the replicas, no stickiness of any kind.
global
    log stdout format raw local0 info
    maxconn 512
    stats socket {stats_socket} mode 600 level admin

defaults
    mode http
    log global
    timeout connect 1s
    timeout client 60s
    timeout server 60s
    timeout http-request 10s
    # Only a failed connect is retried (the request never reached a replica), on another replica. A request that a
    # replica received and then lost is not replayed here: the client retries it (the SDK's max_retries), and
    # statestore's lease decides what that retry may do.
    retries 3
    option redispatch 1

frontend statestore_in
    bind 127.0.0.1:{port}
    capture response header statestore-thread-id len 64
    log-format "%ci:%cp %b/%s %ST %tsc %Tt %{{+Q}}r thread=%hs"
    default_backend statestore

backend statestore
    balance roundrobin
    option httpchk GET /readyz
    http-check expect status 200
    default-server inter 200ms fall 1 rise 2
    http-response set-header {replica_header} %[srv_name]
{servers}
"""


class HAProxy(_Managed):
    """haproxy in the foreground (`-db`), its config and stats socket in `workdir`, its log (stdout) in a file."""

    def __init__(self, workdir: Path, replicas: Sequence[Replica]) -> None:
        binary = require_binary("haproxy", HAPROXY_INSTALL_HINT)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # A unix socket path has at most 107 bytes; pytest's tmp_path under a long TMPDIR can pass that.
        self._socket_dir = (
            workdir if len(str(workdir)) < 90 else Path(tempfile.mkdtemp(prefix="ss-haproxy-", dir="/tmp"))
        )
        self.stats_socket = self._socket_dir / "haproxy.sock"
        self._workdir = workdir
        self.config_path = workdir / "haproxy.cfg"
        self.log_path = workdir / "haproxy.log"
        servers = "\n".join(f"    server {r.name} 127.0.0.1:{r.port} check" for r in replicas)
        self.config_path.write_text(
            _HAPROXY_CONFIG.format(
                stats_socket=self.stats_socket, port=self.port, replica_header=REPLICA_HEADER, servers=servers
            )
        )
        checked = subprocess.run([binary, "-c", "-q", "-f", str(self.config_path)], capture_output=True, check=False)
        if checked.returncode != 0:
            raise RuntimeError(f"haproxy rejected its config:\n{checked.stderr.decode()}")
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [binary, "-db", "-f", str(self.config_path)], stdout=log, stderr=subprocess.STDOUT
            )
        try:
            names = {r.name for r in replicas}
            wait_for("haproxy with every replica UP", lambda: self.up_servers() == names, timeout=15)
        except BaseException:
            self.stop()
            raise

    def stats(self) -> list[dict[str, str]]:
        """`show stat` of the backend's servers, one dict per server (pxname, svname, scur, status, ...)."""
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(2.0)
            sock.connect(str(self.stats_socket))
            sock.sendall(b"show stat\n")
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        text = b"".join(chunks).decode().lstrip("# ")
        rows = csv.DictReader(io.StringIO(text))
        return [row for row in rows if row["pxname"] == "statestore" and row["svname"] not in ("BACKEND", "FRONTEND")]

    def up_servers(self) -> set[str]:
        return {row["svname"] for row in self.stats() if row["status"] == "UP"}

    def current_sessions(self, server: str) -> int:
        return next(int(row["scur"] or 0) for row in self.stats() if row["svname"] == server)

    def log_lines(self) -> Iterator[str]:
        yield from self.log_path.read_text(errors="replace").splitlines()

    def stop(self) -> None:
        _stop(self.process)
        if self._socket_dir != self._workdir:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
