"""Helpers for the reliability tests: private PostgreSQL and Redis instances that a test may crash, kill or pause
(never the shared ones), a statestore process that can be SIGKILLed and restarted on the same port, plain-HTTP
threaded requests, and checks of what the database holds.

PostgreSQL refuses to run as root, so as root `initdb`/`pg_ctl` run as the `postgres` user (`runuser`), in a
temporary directory owned by it. Every instance listens on 127.0.0.1 on a free port and is removed afterwards.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import orjson
import redis
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from tests.support.server import OWNER_SECRET, REPO, free_port, wait_until_up

THREADS_BETA = "message-threads-2026-08-12"
MODEL = "claude-test"
PG_BIN = Path("/usr/lib/postgresql/15/bin")
T = TypeVar("T")


def wait_for(condition: Callable[[], bool], *, within: float, interval: float = 0.05, what: str = "condition") -> float:
    """Poll `condition` until it holds; return the seconds it took. Fails after `within` seconds."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > within:
            raise AssertionError(f"{what} did not hold within {within} s")
        time.sleep(interval)
    return time.monotonic() - started


# == statestore ======================================================================================================


class ServerProcess:
    """`statestore serve` that can be SIGKILLed and started again on the same port, database and settings."""

    def __init__(
        self,
        *,
        database_url: str,
        upstream_url: str,
        redis_url: str | None = None,
        redis_prefix: str = "ss:",
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.gettempdir()) / f"statestore-reliability-{self.port}.log"
        self._env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("STATESTORE_")},
            "STATESTORE_DATABASE_URL": database_url,
            "STATESTORE_UPSTREAM_URL": upstream_url,
            "STATESTORE_OWNER_SECRET": OWNER_SECRET,
            "STATESTORE_REDIS_PREFIX": redis_prefix,
            "STATESTORE_LOG_LEVEL": "INFO",
            **({"STATESTORE_REDIS_URL": redis_url} if redis_url else {}),
            **(env or {}),
        }
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.start()

    def start(self) -> None:
        assert self.process is None or self.process.poll() is not None, "already running"
        with self.log_path.open("ab") as log:
            log.write(f"---- start #{self.starts + 1}\n".encode())
            self.process = subprocess.Popen(
                [sys.executable, "-m", "statestore.cli", "serve", "--port", str(self.port)],
                env=self._env,
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.starts += 1
        try:
            wait_until_up(self.url + "/healthz", self.process)
        except Exception:
            self.stop()
            raise RuntimeError(f"statestore did not start:\n{self.log()}") from None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def kill(self) -> None:
        """SIGKILL: no shutdown hook runs, no lease is given back, no connection is closed politely."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def running_server(**kwargs: Any) -> Iterator[ServerProcess]:
    server = ServerProcess(**kwargs)
    try:
        yield server
    finally:
        server.stop()


# == private PostgreSQL ==============================================================================================


def _as_postgres(command: Sequence[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else list(command)


class PrivatePostgres:
    """A throwaway PostgreSQL 15 cluster of this test's own: it may be crashed (`pg_ctl stop -m immediate`)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="statestore-pg-"))
        self.data = self.dir / "data"
        self.logfile = self.dir / "postgres.log"
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.dir, user.pw_uid, user.pw_gid)
        self._run(
            [str(PG_BIN / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8"]
        )
        # Durable commits as in production (synchronous_commit on), so a crash keeps what was acknowledged.
        self.url = f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, command: Sequence[str], *, timeout: float = 60) -> None:
        done = subprocess.run(_as_postgres(command), capture_output=True, timeout=timeout, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{command[0]} failed ({done.returncode}): {done.stderr.decode(errors='replace')}")

    def start(self) -> None:
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c max_connections=100"
        self._run([str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-o", options, "-l", str(self.logfile), "-w", "start"])

    def create_database(self, name: str) -> None:
        self._run([str(PG_BIN / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", name])

    def crash(self) -> None:
        """Stop the way a crash does: no checkpoint, every backend killed; recovery replays the WAL on start."""
        self._run([str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"])

    def _processes(self) -> list[int]:
        """The postmaster and its children (the backends and auxiliary processes of this cluster only)."""
        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        children = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = Path(f"/proc/{entry}/stat").read_text()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == postmaster:
                    children.append(int(entry))
        return [postmaster, *children]

    def pause(self) -> list[int]:
        """SIGSTOP every process of the cluster: connections stay open and nothing answers (a hung database, as
        behind a network partition). Returns the pids for `resume`."""
        pids = self._processes()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        return pids

    def resume(self, pids: Sequence[int]) -> None:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self._run([str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"])

    def remove(self) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


@contextmanager
def private_postgres() -> Iterator[PrivatePostgres]:
    pg = PrivatePostgres()
    try:
        pg.start()
        yield pg
    finally:
        pg.remove()


# == private Redis ===================================================================================================


class PrivateRedis:
    """A redis-server child process of this test's own, without persistence: a restart starts empty."""

    def __init__(self, *, persistent: bool = False) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.dir = Path(tempfile.mkdtemp(prefix="statestore-redis-"))
        # Persistent: an append-only file synced on every write, so a restart after SIGKILL has every key back.
        self._persistence = ["--appendonly", "yes", "--appendfsync", "always"] if persistent else ["--appendonly", "no"]
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert self.process is None or self.process.poll() is not None, "already running"
        command = [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--dir",
            str(self.dir),
        ]
        command += ["--daemonize", "no", *self._persistence]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(self._answers, within=10, what="redis-server answering PING")

    def _answers(self) -> bool:
        try:
            with self.client() as client:
                return bool(client.ping())
        except redis.RedisError:
            return False

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2, socket_connect_timeout=2)

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def pause(self) -> None:
        """SIGSTOP: connections stay open and nothing answers (a hung Redis)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        process = self.process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGCONT)
            process.kill()
            process.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


@contextmanager
def private_redis(**kwargs: Any) -> Iterator[PrivateRedis]:
    instance = PrivateRedis(**kwargs)
    try:
        instance.start()
        yield instance
    finally:
        instance.stop()


# == the database, read directly ====================================================================================


def _run(coroutine: Coroutine[Any, Any, T]) -> T:
    # The tests are synchronous (the SDK's sync client runs in threads), so no event loop is running here.
    return asyncio.run(coroutine)


def query(database_url: str, sql: str, params: Mapping[str, Any] | None = None) -> list[tuple[Any, ...]]:
    """Rows of one SQL statement, on a connection of its own (closed at once)."""

    async def go() -> list[tuple[Any, ...]]:
        engine = create_async_engine(database_url, poolclass=NullPool, connect_args={"timeout": 5})
        try:
            async with engine.begin() as conn:
                result = await conn.execute(text(sql), dict(params or {}))
                return [tuple(row) for row in result.fetchall()] if result.returns_rows else []
        finally:
            await engine.dispose()

    return _run(go())


def scalar(database_url: str, sql: str, params: Mapping[str, Any] | None = None) -> Any:
    [row] = query(database_url, sql, params)
    return row[0]


def database_name(database_url: str) -> str:
    name = make_url(database_url).database
    assert name is not None
    return name


def statestore_connections(database_url: str) -> dict[str, int]:
    """statestore's connections to this database in pg_stat_activity, by state."""
    rows = query(
        database_url,
        "SELECT coalesce(state, '?'), count(*) FROM pg_stat_activity "
        "WHERE application_name = 'statestore' AND datname = :db GROUP BY 1",
        {"db": database_name(database_url)},
    )
    return {state: int(count) for state, count in rows}


def held_leases(database_url: str) -> int:
    return int(scalar(database_url, "SELECT count(*) FROM threads WHERE lease_token IS NOT NULL"))


@dataclass(frozen=True)
class StoredThread:
    id: str
    head_message_id: str | None
    head_position: int
    messages: list[dict[str, Any]]
    response_ids: list[str | None]


def stored_threads(database_url: str) -> dict[str, StoredThread]:
    """Every thread of the database with its messages in position order, checked to be whole: positions 0..n-1 with
    no gap, n equal to the head position, the head id on the last message, and no message in a thread whose create
    never completed. Fails on a half-written turn."""
    heads = query(database_url, "SELECT id, head_message_id, head_position FROM threads")
    rows = query(database_url, "SELECT thread_id, position, body, response_id FROM thread_messages ORDER BY 1, 2")
    by_thread: dict[str, list[tuple[int, bytes, str | None]]] = {}
    for thread_id, position, body, response_id in rows:
        by_thread.setdefault(thread_id, []).append((position, bytes(body), response_id))
    threads: dict[str, StoredThread] = {}
    for thread_id, head_id, head_position in heads:
        messages = by_thread.pop(thread_id, [])
        positions = [position for position, _, _ in messages]
        assert positions == list(range(len(messages))), f"{thread_id}: positions not contiguous: {positions}"
        assert len(messages) == head_position, f"{thread_id}: {len(messages)} messages, head position {head_position}"
        if head_id is None:
            assert not messages, f"{thread_id}: messages stored for a create that never completed"
        else:
            assert messages[-1][2] == head_id, f"{thread_id}: the head id is not on the last message"
        threads[thread_id] = StoredThread(
            thread_id,
            head_id,
            head_position,
            [orjson.loads(body) for _, body, _ in messages],
            [response_id for _, _, response_id in messages],
        )
    assert not by_thread, f"messages of threads that do not exist: {sorted(by_thread)}"
    return threads


def assert_whole_turns(thread: StoredThread, reply_of: Callable[[str], list[dict[str, Any]]]) -> None:
    """Every user turn of an echo conversation is followed by its own reply. Only replies carry response ids (not
    every reply: the history a create replays is stored without them)."""
    # The sequence itself (test data, no user's content) says which turn came apart, and whether a client replayed it.
    shape = [
        (m["role"][0], m["content"] if isinstance(m["content"], str) else "[blocks]", r is not None)
        for m, r in zip(thread.messages, thread.response_ids, strict=True)
    ]
    assert len(thread.messages) % 2 == 0, f"{thread.id}: odd message count {len(thread.messages)}: {shape}"
    for index in range(0, len(thread.messages), 2):
        asked, answered = thread.messages[index], thread.messages[index + 1]
        assert asked["role"] == "user", (thread.id, index, asked)
        assert answered == {"role": "assistant", "content": reply_of(asked["content"])}, (thread.id, index)
        assert thread.response_ids[index] is None, (thread.id, index)


# == plain HTTP ======================================================================================================


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def echo(text: str) -> list[dict[str, Any]]:
    """The content of the fake backend's default reply to the user turn `text`."""
    return [{"type": "text", "text": f"echo: {text}"}]


class RawClient:
    """Threaded `/v1/messages` requests over plain HTTP for one owner (credential)."""

    def __init__(self, base_url: str, api_key: str, *, timeout: float = 15.0) -> None:
        self.api_key = api_key
        self.http = httpx.Client(
            base_url=base_url,
            headers={
                "x-api-key": api_key,
                "anthropic-version": "2023-06-01",
                "anthropic-beta": THREADS_BETA,
                "content-type": "application/json",
            },
            timeout=timeout,
        )

    @staticmethod
    def body(messages: Sequence[Mapping[str, Any]], previous_id: str | None = None, **fields: Any) -> dict[str, Any]:
        thread = {"type": "create"} if previous_id is None else {"type": "continue", "previous_message_id": previous_id}
        return {"model": MODEL, "max_tokens": 256, **fields, "messages": list(messages), "thread": thread}

    def turn(
        self, messages: Sequence[Mapping[str, Any]], previous_id: str | None = None, **fields: Any
    ) -> httpx.Response:
        return self.http.post("/v1/messages", content=orjson.dumps(self.body(messages, previous_id, **fields)))

    def ok(
        self, messages: Sequence[Mapping[str, Any]], previous_id: str | None = None, **fields: Any
    ) -> dict[str, Any]:
        response = self.turn(messages, previous_id, **fields)
        assert response.status_code == 200, response.text
        reply: dict[str, Any] = response.json()
        return reply

    def export(self, thread_id: str) -> dict[str, Any]:
        response = self.http.get(f"/statestore/v1/threads/{thread_id}/messages")
        assert response.status_code == 200, response.text
        exported: dict[str, Any] = response.json()
        return exported

    def close(self) -> None:
        self.http.close()


def sse_data(raw: bytes) -> list[dict[str, Any]]:
    """The data of each complete event of an SSE body (a trailing partial event is left out)."""
    events = []
    for block in raw.split(b"\n\n")[:-1]:
        data = [line[len(b"data: ") :] for line in block.splitlines() if line.startswith(b"data: ")]
        if data:
            events.append(orjson.loads(b"\n".join(data)))
    return events


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The `error` object of an Anthropic-shaped error response, checked to have that shape and a request id."""
    body = response.json()
    assert body["type"] == "error", body
    assert response.headers.get("request-id"), dict(response.headers)
    error: dict[str, Any] = body["error"]
    return error


# == what a process holds open ======================================================================================


def _tcp_table() -> dict[str, tuple[int, int, str]]:
    """Socket inode -> (local port, remote port, TCP state) of every TCP socket of the machine."""
    table: dict[str, tuple[int, int, str]] = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(name) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
                table[inode] = (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16), state)
    return table


def open_descriptors(pid: int, *, serving_port: int, peers: Mapping[int, str]) -> Counter[str]:
    """The process's open descriptors by kind: "listen", "client" (accepted on `serving_port`), outgoing TCP
    connections named by their remote port (`peers`: port -> name, others "tcp:<port>"), other sockets ("socket")
    and everything else ("other": files, pipes, epoll, eventfd)."""
    table = _tcp_table()
    kinds: Counter[str] = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if not target.startswith("socket:["):
            kinds["other"] += 1
            continue
        tcp = table.get(target[len("socket:[") : -1])
        if tcp is None:
            kinds["socket"] += 1
        elif tcp[2] == "0A":
            kinds["listen"] += 1
        elif tcp[0] == serving_port:
            kinds["client"] += 1
        else:
            kinds[peers.get(tcp[1], f"tcp:{tcp[1]}")] += 1
    return kinds


def live_claims(redis_url: str, prefix: str) -> list[tuple[str, int]]:
    """(thread id, expiry in ms) of every claim on a thread head in Redis (store/thread_claims.py) under `prefix`: a
    continue's hold on its head where claims are on, as a lease is where they are not."""
    client = redis.Redis.from_url(redis_url)
    try:
        now = time.time_ns() // 1_000_000
        held = []
        for key in client.scan_iter(match=f"{prefix}{{*}}:c:*"):
            left = int(client.pttl(key))
            if left > 0:
                thread_id = key.decode()[len(prefix) + 1 :].split("}", 1)[0]
                held.append((thread_id, now + left))
        return held
    finally:
        client.close()


def held_until(database_url: str, redis_url: str, prefix: str, thread_id: str) -> int | None:
    """When the hold on a thread's head that lasts longest runs out (its lease, or a claim in Redis); None: none."""
    ends = [until for held, until in live_leases(database_url) + live_claims(redis_url, prefix) if held == thread_id]
    return max(ends) if ends else None


def live_leases(database_url: str) -> list[tuple[str, int]]:
    """(thread id, lease_expires_ms) of every lease that has not run out yet. A lease that ran out keeps its token in
    the row until the next request takes the head, so `held_leases` counts those too."""
    rows = query(
        database_url,
        "SELECT id, lease_expires_ms FROM threads WHERE lease_token IS NOT NULL AND lease_expires_ms > :now",
        {"now": time.time_ns() // 1_000_000},
    )
    return [(str(thread_id), int(until)) for thread_id, until in rows]
