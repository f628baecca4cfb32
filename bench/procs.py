"""Processes of the benchmark and what the kernel says about them: CPU time and resident memory from /proc.

CPU time is read the way the issue asks, `utime + stime` of `/proc/<pid>/stat` (clock ticks, 10 ms here), summed
over a batch's processes. Those ticks are coarse for a batch of fast requests, so the figures add up the deltas of
every batch of an arm before dividing; `/proc/<pid>/task/*/sched` (`se.sum_exec_runtime`, nanoseconds, per thread)
is read alongside as a precise cross-check and to tell the event loop's thread from the others.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def stat_ticks(pid: int) -> int:
    """utime + stime of the process (all its threads, live and exited), in clock ticks."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    # After the command name: state is field 3, utime field 14, stime field 15 (1-based, man 5 proc).
    return int(fields[11]) + int(fields[12])


def sched_ns_by_thread(pid: int) -> dict[int, int]:
    """se.sum_exec_runtime of every live thread of the process, in nanoseconds."""
    out: dict[int, int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/sched", "rb") as f:
                for line in f:
                    if line.startswith(b"se.sum_exec_runtime"):
                        out[int(tid)] = int(float(line.split(b":", 1)[1]) * 1_000_000)
                        break
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


@dataclass(frozen=True, slots=True)
class CpuSample:
    ticks: int
    sched_ns: int
    main_thread_ns: int  # the threads whose id is a pid of the group: the event loops


def cpu_sample(pids: Sequence[int]) -> CpuSample:
    ticks = sched = main = 0
    for pid in pids:
        ticks += stat_ticks(pid)
        threads = sched_ns_by_thread(pid)
        sched += sum(threads.values())
        main += threads.get(pid, 0)
    return CpuSample(ticks, sched, main)


def rss_kb(pids: Sequence[int]) -> int:
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    total += int(line.split()[1])
                    break
    return total


def children(pid: int) -> list[int]:
    found: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
    return sorted(found)


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except FileNotFoundError:
        return ""


class Service:
    """A child process of the benchmark with its log in a file; stopped by its own pid only."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        log_dir: Path,
        health_url: str,
        cwd: Path = REPO,
    ) -> None:
        self.name = name
        self.health_url = health_url
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            list(argv), env=dict(env), cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_healthy(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.health_url, timeout=1.0).status_code < 500:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} did not answer {self.health_url} within {timeout}s:\n{self.log_tail()}")

    def worker_pids(self, expected: int, timeout: float = 30.0) -> list[int]:
        """The processes that serve requests: the process itself, or its `--workers N` children."""
        if expected == 1:
            return [self.pid]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            workers = [pid for pid in children(self.pid) if "spawn_main" in cmdline(pid)]
            if len(workers) == expected:
                return workers
            time.sleep(0.1)
        raise RuntimeError(f"{self.name}: expected {expected} worker processes under pid {self.pid}")

    def log_tail(self, lines: int = 30) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            # The process group is this service's own (start_new_session): it holds uvicorn's workers too.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()


def python() -> str:
    return sys.executable


def migrate(env: Mapping[str, str], cwd: Path = REPO) -> None:
    """`statestore migrate` with `env` (its STATESTORE_DATABASE_URL), from the code in `cwd`; a failure raises with
    what the command said."""
    migrated = subprocess.run(
        [python(), "-m", "statestore.cli", "migrate"], env=env, cwd=cwd, capture_output=True, text=True, check=False
    )
    if migrated.returncode != 0:
        raise RuntimeError(f"`statestore migrate` failed (code in {cwd}):\n{migrated.stdout}{migrated.stderr}")


def base_worktree(rev: str, work: Path, stack: contextlib.ExitStack) -> Path:
    """REV checked out in a temporary git worktree under `work`, removed when `stack` closes."""
    tree = work / "base"
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], cwd=REPO, check=True)
    stack.callback(subprocess.run, ["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=False)
    return tree


def echo_backend(work: Path, env: Mapping[str, str], stack: contextlib.ExitStack) -> str:
    """statestore's echo backend, answering once this returns, stopped when `stack` closes; its URL."""
    port = free_port()
    echo = Service(
        "echo",
        [python(), "-m", "statestore.cli", "echo-backend", "--port", str(port)],
        env=env,
        log_dir=work,
        health_url=f"http://127.0.0.1:{port}/v1/models",
    )
    stack.callback(echo.stop)
    echo.wait_healthy()
    return f"http://127.0.0.1:{port}"


def machine_busy_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot, from /proc/stat."""
    with open("/proc/stat", "rb") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def load_average() -> float:
    with open("/proc/loadavg", "rb") as f:
        return float(f.read().split()[0])
