"""One side of a counted comparison (bench.bytecodes, bench.instructions): a revision's statestore served under a
counter on a scratch database and Redis prefix of its own, warmed, then continued while the counter runs.

Imported by those two in their main process only: their server-side wrappers run under the other revision's code,
whose bench/ differs."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path

import httpx

from bench.ab import _continue, _continue_response, _create, _create_response
from bench.harness import DEFAULT_PG, DEFAULT_REDIS, _statestore_env, redis_prefix, scratch_database
from bench.procs import Service, free_port, migrate


def serve_side(
    code: Path,
    argv: Callable[[int], Sequence[str]],
    *,
    work: Path,
    stack: ExitStack,
    echo_url: str,
    env: Mapping[str, str] = {},
    health_timeout: float = 30.0,
) -> tuple[Service, str]:
    """The code in `code` served by `argv(port)` (run from `code`, which comes first on the path); its URL."""
    database = stack.enter_context(scratch_database(os.environ.get("STATESTORE_BENCH_PG", DEFAULT_PG)))
    redis_url = os.environ.get("STATESTORE_BENCH_REDIS", DEFAULT_REDIS)
    prefix = stack.enter_context(redis_prefix(redis_url))
    served = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("STATESTORE_", "OTEL_", "PYTHONPATH"))},
        **_statestore_env(
            database.replace("postgresql://", "postgresql+asyncpg://"), redis_url, prefix, echo_url, "WARNING"
        ),
        "STATESTORE_CHAT_UPSTREAM_URL": echo_url,
        "PYTHONPATH": str(code),
        # the editable install maps statestore.migrations to the working tree's folder: each side runs its own
        "STATESTORE_MIGRATIONS_DIR": str(code / "migrations"),
        **env,
    }
    migrate(served, code)
    port = free_port()
    server = Service(
        f"server-{code.name}",
        argv(port),
        env=served,
        log_dir=work,
        health_url=f"http://127.0.0.1:{port}/healthz",
        cwd=code,
    )
    stack.callback(server.stop)
    server.wait_healthy(timeout=health_timeout)
    return server, f"http://127.0.0.1:{port}"


def continue_counted(
    url: str,
    *,
    door: str,
    history_kb: int,
    turns: int,
    warm: int,
    start: Callable[[], None],
    stop: Callable[[], None],
) -> None:
    """A thread (or response chain) continued `warm` times, so that every path is taken once and the pools are full;
    then a new one continued `turns` times between `start()` and `stop()` of the counter."""
    create, step = (_create, _continue) if door == "messages" else (_create_response, _continue_response)
    with httpx.Client(timeout=300) as client:
        previous = create(client, url, history_kb * 1024)
        for n in range(warm):
            previous = step(client, url, previous, n)
        previous = create(client, url, history_kb * 1024)
        start()
        for n in range(turns):
            previous = step(client, url, previous, n)
        stop()
