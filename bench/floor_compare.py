"""`python -m bench.floor_compare`: statestore's threaded continue (C) beside the floor of one (F, bench/floor.py),
the bare relay (R, bench/relay.py, on aiohttp as in `make bench`; R* the same relay on statestore's own HTTP client),
statestore's stateless relay (B) and the backend called directly (A, latency only), side by side in one run.

One echo backend; R, R* and B relay the whole history every turn (≈ 2k tokens by default), F and C continue a thread
with only the new turn. Rounds alternate between the servers; the figures are each server's CPU per turn
(sum_exec_runtime of its threads) and the client's median latency, and the ratios: F/R* is what the round trips and
the parse that durability needs cost any implementation on the same client, C/F what statestore adds to that floor,
F/B and C/B where the floor and statestore stand against relaying the same history statelessly. Fr is the floor with
its lease as a Redis claim (`bench.floor --lease redis`): Fr/F is what moving the lease out of PostgreSQL would save.

    .venv/bin/python -m bench.floor_compare [--rounds 8] [--turns 150] [--history-kb 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import httpx
import orjson

from bench.ab import HEADERS, _continue, _create, history_turns
from bench.harness import DEFAULT_PG, DEFAULT_REDIS, _statestore_env, redis_prefix, scratch_database
from bench.procs import Service, cpu_sample, free_port, migrate, python


def _history_body(history_bytes: int, n: int) -> bytes:
    turns = [*history_turns(history_bytes), {"role": "user", "content": f"turn {n}: " + "x" * 150}]
    return orjson.dumps({"model": "bench-1", "max_tokens": 64, "messages": turns})


def _measure(pid: int, turns: int, one: Callable[[int], None]) -> tuple[float, float]:
    before = cpu_sample([pid])
    latencies = []
    for n in range(turns):
        started = time.perf_counter()
        one(n)
        latencies.append(time.perf_counter() - started)
    return (cpu_sample([pid]).sched_ns - before.sched_ns) / turns / 1000, statistics.median(latencies) * 1000


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.floor_compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8, help="rounds per server, interleaved (default 8)")
    parser.add_argument("--turns", type=int, default=150, help="turns per round (default 150)")
    parser.add_argument("--history-kb", type=int, default=8, help="history, KiB (default 8: ≈ 2k tokens)")
    args = parser.parse_args(argv)
    admin_dsn = os.environ.get("STATESTORE_BENCH_PG", DEFAULT_PG)
    redis_url = os.environ.get("STATESTORE_BENCH_REDIS", DEFAULT_REDIS)
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("STATESTORE_", "OTEL_"))}
    history = args.history_kb * 1024

    with tempfile.TemporaryDirectory(prefix="bench-floor-") as scratch, ExitStack() as stack:
        work = Path(scratch)

        def start(name: str, argv: list[str], env: dict[str, str], health: str) -> tuple[Service, str]:
            port = free_port()
            service = Service(
                name, [*argv, "--port", str(port)], env=env, log_dir=work, health_url=f"http://127.0.0.1:{port}{health}"
            )
            stack.callback(service.stop)
            service.wait_healthy()
            return service, f"http://127.0.0.1:{port}"

        echo, echo_url = start("echo", [python(), "-m", "statestore.cli", "echo-backend"], base_env, "/v1/models")
        relay, relay_url = start(
            "relay",
            [python(), "-m", "bench.relay", "--upstream", echo_url, "--client", "aiohttp"],
            base_env,
            "/v1/models",
        )
        lean_relay, lean_relay_url = start(
            "relay-statestore-client",
            [python(), "-m", "bench.relay", "--upstream", echo_url, "--client", "statestore"],
            base_env,
            "/v1/models",
        )

        def start_floor(name: str, lease: str) -> tuple[Service, str]:
            database = stack.enter_context(scratch_database(admin_dsn))
            prefix = stack.enter_context(redis_prefix(redis_url))
            argv = [python(), "-m", "bench.floor", "--upstream", echo_url, "--database", database]
            argv += ["--redis", redis_url, "--redis-prefix", prefix, "--lease", lease]
            return start(name, argv, base_env, "/missing")

        floor, floor_url = start_floor("floor", "postgres")
        claimed_floor, claimed_floor_url = start_floor("floor-redis-lease", "redis")
        database = stack.enter_context(scratch_database(admin_dsn)).replace("postgresql://", "postgresql+asyncpg://")
        prefix = stack.enter_context(redis_prefix(redis_url))
        env = {**base_env, **_statestore_env(database, redis_url, prefix, echo_url, "WARNING")}
        migrate(env)
        statestore, statestore_url = start("statestore", [python(), "-m", "statestore.cli", "serve"], env, "/healthz")

        results: dict[str, list[tuple[float, float]]] = {
            "A": [],
            "R": [],
            "R*": [],
            "B": [],
            "F": [],
            "Fr": [],
            "C": [],
        }
        with httpx.Client(timeout=30) as client:

            def relay_round(service: Service, url: str, turns: int) -> tuple[float, float]:
                bodies = [_history_body(history, n) for n in range(turns)]

                def one(n: int) -> None:
                    client.post(url + "/v1/messages", content=bodies[n], headers=HEADERS).raise_for_status()

                return _measure(service.pid, turns, one)

            def thread_round(service: Service, url: str, turns: int) -> tuple[float, float]:
                head = [_create(client, url, history)]

                def one(n: int) -> None:
                    head[0] = _continue(client, url, head[0], n)

                return _measure(service.pid, turns, one)

            arms: dict[str, Callable[[int], tuple[float, float]]] = {
                # A: the backend called directly; its CPU is the backend's, so only its latency is reported.
                "A": lambda turns: relay_round(echo, echo_url, turns),
                "R": lambda turns: relay_round(relay, relay_url, turns),
                "R*": lambda turns: relay_round(lean_relay, lean_relay_url, turns),
                "B": lambda turns: relay_round(statestore, statestore_url, turns),
                "F": lambda turns: thread_round(floor, floor_url, turns),
                "Fr": lambda turns: thread_round(claimed_floor, claimed_floor_url, turns),
                "C": lambda turns: thread_round(statestore, statestore_url, turns),
            }
            for arm in arms.values():  # a warm-up round each, not counted
                arm(max(20, args.turns // 10))
            for i in range(args.rounds):
                names = list(arms)
                for name in names[i % len(names) :] + names[: i % len(names)]:
                    results[name].append(arms[name](args.turns))

    cpu = {name: statistics.median(r[0] for r in rows) for name, rows in results.items()}
    latency = {name: statistics.median(r[1] for r in rows) for name, rows in results.items()}
    print(f"{args.rounds} rounds x {args.turns} turns per server, interleaved; history {args.history_kb} KiB")
    print("arm | server CPU per turn | client p50 latency")
    for name in results:
        server_cpu = f"{cpu[name]:12.0f} µs" if name != "A" else f"{'-':>12}   "
        print(f"{name:3} | {server_cpu}     | {latency[name]:8.2f} ms")
    print(
        f"CPU: C/R {cpu['C'] / cpu['R']:.2f}x, R*/R {cpu['R*'] / cpu['R']:.2f}x, F/R* {cpu['F'] / cpu['R*']:.2f}x, "
        f"C/F {cpu['C'] / cpu['F']:.2f}x, F/B {cpu['F'] / cpu['B']:.2f}x, C/B {cpu['C'] / cpu['B']:.2f}x; "
        f"latency: C-F {latency['C'] - latency['F']:+.2f} ms, F-R* {latency['F'] - latency['R*']:+.2f} ms"
    )
    print(
        f"the lease as a Redis claim (Fr): Fr/F CPU {cpu['Fr'] / cpu['F']:.2f}x, "
        f"latency Fr-F {latency['Fr'] - latency['F']:+.2f} ms; C/Fr {cpu['C'] / cpu['Fr']:.2f}x"
    )
    added = ", ".join(f"{name} {latency[name] - latency['A']:+.2f}" for name in results if name != "A")
    print(f"latency added over calling the backend directly (A), p50: {added} ms")


if __name__ == "__main__":
    main()
