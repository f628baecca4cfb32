"""A real statestore server process for integration tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
OWNER_SECRET = "test-owner-secret-0123456789abcdef"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_until_up(url: str, process: subprocess.Popen[Any], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    # One client for every attempt: a new one loads the CA bundle (tens of milliseconds of CPU), and one per attempt
    # had the test process burn about half the CPU the server needs to start, while it started.
    with httpx.Client(timeout=0.5) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"server exited with {process.returncode} before answering on {url}")
            try:
                if client.get(url).status_code < 500:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    raise RuntimeError(f"server did not answer on {url} within {timeout}s")


class StatestoreServer:
    """`statestore serve` in its own process; its log goes to a file the tests can read."""

    def __init__(
        self,
        *,
        database_url: str,
        upstream_url: str,
        redis_url: str | None = None,
        redis_prefix: str = "ss:",
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        command: Sequence[str] | None = None,
        cwd: Path = REPO,
    ) -> None:
        """`command` runs another installation's `statestore` (its argv up to `serve`), from `cwd`."""
        self.port = free_port()
        self.database_url = database_url
        self.redis_prefix = redis_prefix
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path or Path(os.environ.get("TMPDIR", "/tmp")) / f"statestore-{self.port}.log"
        full_env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("STATESTORE_")},
            "STATESTORE_DATABASE_URL": database_url,
            "STATESTORE_UPSTREAM_URL": upstream_url,
            "STATESTORE_OWNER_SECRET": OWNER_SECRET,
            "STATESTORE_REDIS_PREFIX": redis_prefix,
            "STATESTORE_LOG_LEVEL": "INFO",
            **({"STATESTORE_REDIS_URL": redis_url} if redis_url else {}),
            **(env or {}),
        }
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [*(command or [sys.executable, "-m", "statestore.cli"]), "serve", "--port", str(self.port)],
            env=full_env,
            cwd=cwd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_until_up(self.url + "/healthz", self.process)
        except Exception:
            self.stop()
            raise RuntimeError(f"statestore did not start:\n{self.log()}") from None

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
