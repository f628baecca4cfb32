"""`make run` as the README's first minute uses it: the echo backend and statestore come up, a thread is created and
continued and a response answered and continued; a port already taken is refused before anything starts, naming the
setting that moves it. The database is a temporary SQLite file and the owner secret is set, so the checkout is left as
it was."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.packaging.conftest import REPO
from tests.support.server import OWNER_SECRET, free_port, wait_until_up

HEADERS = {"x-api-key": "my-key", "anthropic-beta": "message-threads-2026-08-12"}


def make_run(tmp_path: Path, port: int, echo_port: int) -> subprocess.Popen[str]:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("STATESTORE_")},
        "STATESTORE_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'statestore.db'}",
        "STATESTORE_OWNER_SECRET": OWNER_SECRET,
    }
    return subprocess.Popen(
        ["make", "-s", "run", f"PORT={port}", f"ECHO_PORT={echo_port}"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@contextmanager
def listening() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def test_make_run_serves_the_first_minute(tmp_path: Path) -> None:
    port, echo_port = free_port(), free_port()
    process = make_run(tmp_path, port, echo_port)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_up(base + "/readyz", process, timeout=120)
        with httpx.Client(base_url=base, headers=HEADERS, timeout=10) as client:
            created = client.post(
                "/v1/messages",
                json={
                    "model": "echo-1",
                    "max_tokens": 200,
                    "thread": {"type": "create"},
                    "messages": [{"role": "user", "content": "Hello, statestore"}],
                },
            )
            assert created.status_code == 200, created.text
            assert created.headers["statestore-thread-id"].startswith("thr_")
            assert created.json()["content"][0]["text"] == "echo: Hello, statestore"
            continued = client.post(
                "/v1/messages",
                json={
                    "model": "echo-1",
                    "max_tokens": 200,
                    "thread": {"type": "continue", "previous_message_id": created.json()["id"]},
                    "messages": [{"role": "user", "content": "Only this turn is sent"}],
                },
            )
            assert continued.status_code == 200, continued.text
            assert continued.json()["content"][0]["text"] == "echo: Only this turn is sent"
            # The second front door answers through the same echo backend, and continues from a response's id.
            response = client.post("/v1/responses", json={"model": "echo-1", "input": "Hello, statestore"})
            assert response.status_code == 200, response.text
            assert response.json()["output"][0]["content"][0]["text"] == "echo: Hello, statestore"
            chained = client.post(
                "/v1/responses",
                json={
                    "model": "echo-1",
                    "input": "Only this turn is sent",
                    "previous_response_id": response.json()["id"],
                },
            )
            assert chained.status_code == 200, chained.text
            assert chained.json()["output"][0]["content"][0]["text"] == "echo: Only this turn is sent"
            assert chained.json()["previous_response_id"] == response.json()["id"]
    finally:
        stop(process)


@pytest.mark.parametrize("taken", ["PORT", "ECHO_PORT"])
def test_make_run_refuses_a_port_already_in_use(tmp_path: Path, taken: str) -> None:
    with listening() as busy:
        free = free_port()
        port, echo_port = (busy, free) if taken == "PORT" else (free, busy)
        process = make_run(tmp_path, port, echo_port)
        try:
            _, stderr = process.communicate(timeout=120)
        finally:
            stop(process)
    assert process.returncode != 0
    assert f"port {busy} is already in use" in stderr
    assert f"make run {taken}=<port>" in stderr
    # Refused before anything started: neither server answers on the free port, and no database was made.
    time.sleep(0.2)
    assert not answers(free)
    assert not (tmp_path / "statestore.db").exists()
