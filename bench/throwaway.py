"""A PostgreSQL cluster and a Redis server of the bench's own, started for one run and removed after it, so that what
the bench reads from them (pg_stat_statements, their processes' CPU) is statestore's alone and no other work on the
machine's shared services lands on it.

The cluster is made with initdb and pg_ctl from STATESTORE_BENCH_PG_BIN (by default /usr/lib/postgresql/15/bin) under
a work directory, with initdb's defaults (as the machine's own cluster runs), listening on 127.0.0.1 on a free port;
PostgreSQL refuses to run as root, so as root it runs as `postgres`. Redis runs with no persistence (statestore's
cache is rebuilt from the database, so a deployment need not keep it on disk).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import redis

from bench.procs import free_port

DEFAULT_PG_BIN = "/usr/lib/postgresql/15/bin"


def pg_bin() -> Path:
    return Path(os.environ.get("STATESTORE_BENCH_PG_BIN", DEFAULT_PG_BIN))


def _as_owner(argv: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: the cluster then runs as `postgres`."""
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv


@contextlib.contextmanager
def postgres_cluster(work: Path, *, statements: bool = False) -> Iterator[str]:
    """A cluster's admin DSN; stopped and removed at the end. With `statements`, pg_stat_statements is preloaded
    (tracking nested statements too) and I/O timing is on."""
    bin_dir = pg_bin()
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
    settings = {"port": str(port), "listen_addresses": "'127.0.0.1'", "unix_socket_directories": f"'{work}'"}
    if statements:
        settings |= {
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


@contextlib.contextmanager
def redis_server(work: Path, timeout: float = 10.0) -> Iterator[str]:
    """A redis-server's URL (from PATH, or STATESTORE_BENCH_REDIS_SERVER); stopped by its own pid at the end."""
    with redis_process(work, timeout) as (url, _):
        yield url


@contextlib.contextmanager
def redis_process(work: Path, timeout: float = 10.0) -> Iterator[tuple[str, int]]:
    """A redis-server's URL and pid (to bill its CPU), as redis_server."""
    port = free_port()
    argv = [
        os.environ.get("STATESTORE_BENCH_REDIS_SERVER", "redis-server"),
        *("--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(work)),
    ]
    with (work / "redis.log").open("wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        _wait_for_redis(url, process, time.monotonic() + timeout, work / "redis.log")
        yield url, process.pid
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_for_redis(url: str, process: subprocess.Popen[bytes], deadline: float, log: Path) -> None:
    client = redis.Redis.from_url(url)
    try:
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start: see {log}") from None
                time.sleep(0.05)
    finally:
        client.close()
