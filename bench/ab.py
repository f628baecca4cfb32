"""`python -m bench.ab --base REV`: the working tree's statestore against another revision's, side by side in one run.

Two statestore servers, each on a scratch PostgreSQL database and a Redis prefix of its own, in front of one echo
backend: "base" runs the code of REV (a temporary git worktree, on the same venv), "head" runs the working tree.
Rounds alternate between them; each round is one new thread continued `--turns` times, one turn at a time (≈ 2k
tokens of history by default), and the figures are each server's CPU (sum_exec_runtime of its threads) and the
client's latency per continue. The ratio head/base is what a change costs or saves, on whatever else the machine is
doing at the time, since both arms suffer it alike.

    .venv/bin/python -m bench.ab --base HEAD~1 [--rounds 8] [--turns 150] [--history-kb 8] [--stream]
        [--door messages|responses] [--branch] [--repeat K] [--own-redis]

`--branch` (with `--door responses`) times branches instead: a chain of `--turns` responses is made first, uncounted,
then one is continued from each response of it but its head, deepest first, so that each reads its context from the
database, as a continue does when its chain's context is not in the cache.

`--own-redis` gives each server a redis-server of its own and bills its CPU with the server's: the whole turn's CPU
(statestore and Redis), as a change of Redis client is weighed.

On these small shared machines one run's ratio can stray by 5 % or more (two A/A runs have read 0.96x and 1.06x):
`--repeat K` makes K whole runs, each on fresh servers, and reports the median of their ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import orjson

from bench.harness import DEFAULT_PG, DEFAULT_REDIS, _statestore_env, redis_prefix, scratch_database
from bench.procs import REPO, Service, base_worktree, cpu_sample, echo_backend, free_port, migrate, python
from bench.throwaway import redis_process

THREADS_BETA = "message-threads-2026-08-12"
HEADERS = {"content-type": "application/json", "x-api-key": "bench-ab", "anthropic-beta": THREADS_BETA}


def history_turns(history_bytes: int) -> list[dict[str, str]]:
    """Alternating user and assistant text of about `history_bytes`, ending with an assistant turn."""
    turns: list[dict[str, str]] = []
    while sum(len(t["content"]) for t in turns) < history_bytes or turns[-1]["role"] == "user":
        role = "user" if len(turns) % 2 == 0 else "assistant"
        turns.append({"role": role, "content": f"turn {len(turns)}: a line of history, café ☕. " * 8})
    return turns


def _create(client: httpx.Client, url: str, history_bytes: int) -> str:
    turns = [*history_turns(history_bytes), {"role": "user", "content": "and now?"}]
    body = {"model": "bench-1", "max_tokens": 64, "thread": {"type": "create"}, "messages": turns}
    reply = client.post(url + "/v1/messages", json=body, headers=HEADERS)
    reply.raise_for_status()
    message_id: str = reply.json()["id"]
    return message_id


def _continue(client: httpx.Client, url: str, previous: str, n: int, *, stream: bool = False) -> str:
    body = {
        "model": "bench-1",
        "max_tokens": 64,
        "thread": {"type": "continue", "previous_message_id": previous},
        "messages": [{"role": "user", "content": f"turn {n}: " + "x" * 150}],
    }
    if stream:
        body["stream"] = True
    reply = client.post(url + "/v1/messages", json=body, headers=HEADERS)
    reply.raise_for_status()
    if stream:
        return _streamed_id(reply.content)
    message_id: str = reply.json()["id"]
    return message_id


def _streamed_id(body: bytes) -> str:
    """The message id of a stream, from its message_start; a stream without message_stop is a failed turn."""
    if b"event: message_stop" not in body:
        raise RuntimeError("the stream ended without message_stop")
    start = body.index(b"data: ") + 6
    message_id: str = orjson.loads(body[start : body.index(b"\n", start)])["message"]["id"]
    return message_id


def _create_response(client: httpx.Client, url: str, history_bytes: int) -> str:
    items = [*history_turns(history_bytes), {"role": "user", "content": "and now?"}]
    reply = client.post(url + "/v1/responses", json={"model": "bench-1", "input": items}, headers=HEADERS)
    reply.raise_for_status()
    response_id: str = reply.json()["id"]
    return response_id


def _continue_response(client: httpx.Client, url: str, previous: str, n: int, *, stream: bool = False) -> str:
    body: dict[str, object] = {"model": "bench-1", "previous_response_id": previous, "input": f"turn {n}: " + "x" * 150}
    if stream:
        body["stream"] = True
    reply = client.post(url + "/v1/responses", json=body, headers=HEADERS)
    reply.raise_for_status()
    if stream:
        if b"event: response.completed" not in reply.content:
            raise RuntimeError("the stream ended without response.completed")
        start = reply.content.index(b"data: ") + 6
        streamed: str = orjson.loads(reply.content[start : reply.content.index(b"\n", start)])["response"]["id"]
        return streamed
    response_id: str = reply.json()["id"]
    return response_id


def branch_points(client: httpx.Client, url: str, root: str, turns: int, *, stream: bool = False) -> list[str]:
    """`turns` responses whose chain's context is not in the cache, deepest first: a chain continued `turns` times
    from `root`, but its head. Each continue moved its parent's cached context on to it, so a branch from any of them
    reads its context from the database."""
    chain = [root]
    for n in range(turns):
        chain.append(_continue_response(client, url, chain[-1], n, stream=stream))
    return chain[-2::-1]


def _round(
    client: httpx.Client,
    pids: list[int],
    url: str,
    turns: int,
    history: int,
    *,
    stream: bool,
    door: str,
    branch: bool = False,
) -> tuple[float, float]:
    """(CPU µs per continue of the processes `pids`, median client latency ms) of one thread (or response chain) of
    `turns` continues; `branch`: of `turns` branches from a response chain made first, uncounted."""
    create, step = (_create, _continue) if door == "messages" else (_create_response, _continue_response)
    previous = create(client, url, history)
    points = branch_points(client, url, previous, turns, stream=stream) if branch else []
    before = cpu_sample(pids)
    latencies = []
    for n in range(turns):
        started = time.perf_counter()
        if branch:
            step(client, url, points[n], n, stream=stream)
        else:
            previous = step(client, url, previous, n, stream=stream)
        latencies.append(time.perf_counter() - started)
    cpu_ns = cpu_sample(pids).sched_ns - before.sched_ns
    return cpu_ns / turns / 1000, statistics.median(latencies) * 1000


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the git revision to compare the working tree with")
    parser.add_argument("--rounds", type=int, default=8, help="rounds per server, interleaved (default 8)")
    parser.add_argument("--turns", type=int, default=150, help="continues per round (default 150)")
    parser.add_argument("--history-kb", type=int, default=8, help="history of each thread, KiB (default 8: ≈ 2k)")
    parser.add_argument("--stream", action="store_true", help="continue with streamed (SSE) turns instead of JSON")
    parser.add_argument(
        "--door",
        choices=("messages", "responses"),
        default="messages",
        help="threaded continues (default), or Responses continues with previous_response_id",
    )
    parser.add_argument(
        "--branch",
        action="store_true",
        help="with --door responses: each continue a branch from a response whose context is not cached (read from "
        "the database), below the head of a chain made first",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="STATESTORE_X=VALUE",
        help="a setting for both servers (repeatable), e.g. STATESTORE_LOG_LEVEL=INFO to count the access log in",
    )
    parser.add_argument(
        "--head-set",
        action="append",
        default=[],
        metavar="STATESTORE_X=VALUE",
        help="a setting for the head server only (repeatable; an empty value unsets it), e.g. to weigh one part",
    )
    parser.add_argument(
        "--own-redis",
        action="store_true",
        help="a redis-server of its own for each server, its CPU billed with the server's (the whole turn)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="whole runs, each on fresh servers; the median of their ratios is the figure (default 1)",
    )
    args = parser.parse_args(argv)
    if args.branch and args.door != "responses":
        parser.error("--branch needs --door responses")
    ratios: list[tuple[float, float]] = []
    for run in range(args.repeat):
        cpu, latency = _run(args)
        cpu_ratio, latency_ratio = cpu["head"] / cpu["base"], latency["head"] / latency["base"]
        ratios.append((cpu_ratio, latency_ratio))
        if run == 0:
            print(
                f"{args.rounds} rounds x {args.turns} {'threaded' if args.door == 'messages' else 'Responses'} "
                f"{'streamed' if args.stream else 'JSON'} {'branches' if args.branch else 'continues'} per server, "
                f"interleaved; history {args.history_kb} KiB"
            )
        if args.repeat > 1:
            print(f"run {run + 1} of {args.repeat}:")
        print("server | CPU per continue | client p50 latency")
        for name in cpu:
            print(f"{name:6} | {cpu[name]:11.0f} µs   | {latency[name]:8.2f} ms")
        print(f"head / base ({args.base}): CPU {cpu_ratio:.3f}x, latency {latency_ratio:.3f}x")
    if args.repeat > 1:
        cpu_median = statistics.median(r[0] for r in ratios)
        latency_median = statistics.median(r[1] for r in ratios)
        print(
            f"median of {args.repeat} runs, head / base ({args.base}): CPU {cpu_median:.3f}x, "
            f"latency {latency_median:.3f}x (CPU from {min(r[0] for r in ratios):.3f}x to "
            f"{max(r[0] for r in ratios):.3f}x)"
        )


def _run(args: argparse.Namespace) -> tuple[dict[str, float], dict[str, float]]:
    """One whole run on fresh servers: each server's median CPU (µs) and client p50 (ms) per continue."""
    admin_dsn = os.environ.get("STATESTORE_BENCH_PG", DEFAULT_PG)
    redis_url = os.environ.get("STATESTORE_BENCH_REDIS", DEFAULT_REDIS)
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("STATESTORE_", "OTEL_", "PYTHONPATH"))}

    with tempfile.TemporaryDirectory(prefix="bench-ab-") as scratch, ExitStack() as stack:
        work = Path(scratch)
        tree = base_worktree(args.base, work, stack)
        echo_url = echo_backend(work, base_env, stack)
        services: dict[str, tuple[list[int], str]] = {}
        for name, code in (("base", tree), ("head", REPO)):
            database = stack.enter_context(scratch_database(admin_dsn)).replace(
                "postgresql://", "postgresql+asyncpg://"
            )
            billed: list[int] = []
            side_redis = redis_url
            if args.own_redis:
                (work / f"redis-{name}").mkdir()
                side_redis, redis_pid = stack.enter_context(redis_process(work / f"redis-{name}"))
                billed.append(redis_pid)
            prefix = stack.enter_context(redis_prefix(side_redis))
            env = {
                **base_env,
                **_statestore_env(database, side_redis, prefix, echo_url, "WARNING"),
                "STATESTORE_CHAT_UPSTREAM_URL": echo_url,
                "PYTHONPATH": str(code),  # `python -m` also puts the working directory, `code`, first
                # the editable install maps statestore.migrations to the working tree's folder: each side runs its own
                "STATESTORE_MIGRATIONS_DIR": str(code / "migrations"),
            }
            for setting in [*args.set, *(args.head_set if name == "head" else [])]:
                key, _, value = setting.partition("=")
                env.pop(key, None)
                if value:
                    env[key] = value
            migrate(env, code)
            port = free_port()
            service = Service(
                name,
                [python(), "-m", "statestore.cli", "serve", "--port", str(port)],
                env=env,
                log_dir=work,
                health_url=f"http://127.0.0.1:{port}/healthz",
                cwd=code,
            )
            stack.callback(service.stop)
            service.wait_healthy()
            services[name] = ([service.pid, *billed], f"http://127.0.0.1:{port}")
        history = args.history_kb * 1024
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in services}
        with httpx.Client(timeout=30) as client:
            for pids, url in services.values():  # a warm-up round each, not counted
                _round(
                    client,
                    pids,
                    url,
                    max(20, args.turns // 10),
                    history,
                    stream=args.stream,
                    door=args.door,
                    branch=args.branch,
                )
            for i in range(args.rounds):
                order = list(services.items()) if i % 2 == 0 else list(reversed(services.items()))
                for name, (pids, url) in order:
                    results[name].append(
                        _round(
                            client,
                            pids,
                            url,
                            args.turns,
                            history,
                            stream=args.stream,
                            door=args.door,
                            branch=args.branch,
                        )
                    )

    cpu = {name: statistics.median(r[0] for r in rows) for name, rows in results.items()}
    latency = {name: statistics.median(r[1] for r in rows) for name, rows in results.items()}
    return cpu, latency


if __name__ == "__main__":
    main()
