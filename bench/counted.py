"""One side of a counted comparison (bench.bytecodes, bench.instructions): a revision's statestore served under a
counter on a scratch database and Redis prefix of its own, warmed, then continued while the counter runs.

Imported by those two in their main process only: their server-side wrappers run under the other revision's code,
whose bench/ differs."""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TypeVar

import httpx
import orjson
from websockets.sync.client import connect
from websockets.sync.connection import Connection

from bench.ab import HEADERS, _continue, _continue_response, _create, _create_response, branch_points
from bench.harness import DEFAULT_PG, DEFAULT_REDIS, _statestore_env, redis_prefix, scratch_database
from bench.procs import REPO, Service, base_worktree, echo_backend, free_port, migrate, python

R = TypeVar("R")


def arguments(
    prog: str, doc: str, argv: list[str] | None, *, turns: int, top: int, top_help: str, callgrind: bool = False
) -> argparse.Namespace:
    """The options both counters take: `--base REV`, `--door`, `--branch`, `--turns`, `--history-kb`, `--top`; with
    `callgrind`, bench.instructions' own too: `--floor` in place of `--base`, and `--cache`."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n", maxsplit=1)[0])
    sides = parser.add_mutually_exclusive_group(required=True)
    sides.add_argument("--base", help="the git revision to compare the working tree with")
    if callgrind:
        sides.add_argument(
            "--floor",
            action="store_true",
            help="compare the working tree's threaded continue with the floor of one (bench/floor.py) instead",
        )
    parser.add_argument(
        "--door",
        choices=("messages", "responses", "socket"),
        default="messages",
        help="threaded or Responses continues, or Responses continues over one WebSocket (WebSocket mode)",
    )
    parser.add_argument(
        "--branch",
        action="store_true",
        help="with --door responses: count branches from responses whose context is not cached (bench.ab's)",
    )
    parser.add_argument("--turns", type=int, default=turns, help=f"continues counted per side (default {turns})")
    parser.add_argument("--history-kb", type=int, default=8, help="history of the thread, KiB (default 8: ≈ 2k)")
    parser.add_argument("--top", type=int, default=top, help=top_help)
    if callgrind:
        parser.add_argument(
            "--cache",
            action="store_true",
            help="simulate the caches and branch predictors too, and estimate cycles (about twice as slow)",
        )
    args = parser.parse_args(argv)
    if args.branch and args.door != "responses":
        parser.error("--branch needs --door responses")
    return args


def both_sides(
    base: str | None,
    count: Callable[[Path, Path, ExitStack, str], R],
    *,
    floor: Callable[[Path, ExitStack, str], R] | None = None,
) -> tuple[R, R]:
    """`count(code, work, stack, echo_url)` of REV's code (a temporary worktree), or `floor(work, stack, echo_url)`,
    then `count` of the working tree's, in front of one echo backend."""
    with tempfile.TemporaryDirectory(prefix="bench-counted-") as scratch, ExitStack() as stack:
        work = Path(scratch)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("STATESTORE_", "PYTHONPATH"))}
        echo_url = echo_backend(work, env, stack)
        if floor is not None:
            first = floor(work, stack, echo_url)
        else:
            assert base is not None
            first = count(base_worktree(base, work, stack), work, stack, echo_url)
        return first, count(REPO, work, stack, echo_url)


def serve_floor(
    counter: Sequence[str], *, work: Path, stack: ExitStack, echo_url: str, health_timeout: float
) -> tuple[Service, str]:
    """The working tree's floor of a threaded turn (bench/floor.py, arm F) run under `counter`, on a scratch database
    and Redis prefix of its own; its URL."""
    database = stack.enter_context(scratch_database(os.environ.get("STATESTORE_BENCH_PG", DEFAULT_PG)))
    redis_url = os.environ.get("STATESTORE_BENCH_REDIS", DEFAULT_REDIS)
    prefix = stack.enter_context(redis_prefix(redis_url))
    port = free_port()
    floor = [python(), "-m", "bench.floor", "--port", str(port), "--upstream", echo_url, "--database", database]
    server = Service(
        "floor",
        [*counter, *floor, "--redis", redis_url, "--redis-prefix", prefix],
        env={k: v for k, v in os.environ.items() if not k.startswith(("STATESTORE_", "OTEL_", "PYTHONPATH"))},
        log_dir=work,
        health_url=f"http://127.0.0.1:{port}/missing",  # any answer but a 5xx: the floor serves one route
    )
    stack.callback(server.stop)
    server.wait_healthy(timeout=health_timeout)
    return server, f"http://127.0.0.1:{port}"


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
    url: str, args: argparse.Namespace, *, warm: int, start: Callable[[], None], stop: Callable[[], None]
) -> None:
    """A thread (or response chain) continued `warm` times, so that every path is taken once and the pools are full;
    then a new one continued `args.turns` times between `start()` and `stop()` of the counter. `--branch`: branches
    from responses whose context is not cached instead (bench.ab's), `warm` of them before the counted ones."""
    create = _create if args.door == "messages" else _create_response
    step: Step = _continue if args.door == "messages" else _continue_response
    history = args.history_kb * 1024
    with httpx.Client(timeout=300) as client, ExitStack() as stack:
        if args.door == "socket":
            socket = connect(
                url.replace("http://", "ws://") + "/v1/responses",
                additional_headers=HEADERS,
                max_size=None,
                compression=None,
                open_timeout=300,  # a server under callgrind
                ping_interval=None,
            )
            step = socket_turns(stack.enter_context(socket))
        previous = create(client, url, history)
        for n in range(warm):
            previous = step(client, url, previous, n)
        if args.branch:
            for n, point in enumerate(branch_points(client, url, previous, warm)):
                step(client, url, point, n)
            points = branch_points(client, url, create(client, url, history), args.turns)
            start()
            for n, point in enumerate(points):
                step(client, url, point, n)
            stop()
            return
        previous = create(client, url, history)
        start()
        for n in range(args.turns):
            previous = step(client, url, previous, n)
        stop()


Step = Callable[[httpx.Client, str, str, int], str]  # a continue: client, URL, previous id, n -> the new id


def socket_turns(socket: Connection) -> Step:
    """Responses continues over one WebSocket (WebSocket mode), as `_continue_response`'s over HTTP: a
    `response.create` with the same input, its events read to `response.completed`."""

    def step(_client: httpx.Client, _url: str, previous: str, n: int) -> str:
        event = {"type": "response.create", "model": "bench-1", "previous_response_id": previous}
        socket.send(orjson.dumps({**event, "input": f"turn {n}: " + "x" * 150}).decode())
        while True:
            message = orjson.loads(socket.recv(timeout=300))
            if message["type"] == "response.completed":
                response_id: str = message["response"]["id"]
                return response_id
            if message["type"] == "error":
                raise RuntimeError(f"socket: {message}")

    return step
