"""`python -m bench.tracing`: what OpenTelemetry tracing costs, off and on, measured side by side in one run.

Two statestore processes on SQLite files of their own, in front of one echo backend: one with no OTEL_* variable
(tracing off: the plain serving objects), one with OTEL_TRACES_EXPORTER=console (on: every span built and exported,
to its log file). Rounds alternate between them; each round is one thread of `--turns` threaded continues, one at a
time, and the figures are each server's CPU (sum_exec_runtime of its threads) and the client's latency per turn. Off
is the baseline: the ratios say what turning tracing on costs. Off itself runs exactly the objects a build without
tracing ran (tests/integration/test_tracing.py::test_off_means_the_plain_objects_serve), so it costs nothing.

    make install && .venv/bin/python -m bench.tracing [--rounds 6] [--turns 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from bench.procs import Service, cpu_sample, free_port, python

THREADS_BETA = "message-threads-2026-08-12"
HEADERS = {"content-type": "application/json", "x-api-key": "bench-tracing", "anthropic-beta": THREADS_BETA}


def _turn(client: httpx.Client, url: str, previous: str | None, n: int) -> str:
    thread = {"type": "create"} if previous is None else {"type": "continue", "previous_message_id": previous}
    body = {
        "model": "bench-1",
        "max_tokens": 64,
        "thread": thread,
        "messages": [{"role": "user", "content": f"turn {n}: " + "x" * 400}],
    }
    reply = client.post(url + "/v1/messages", json=body, headers=HEADERS)
    reply.raise_for_status()
    message_id: str = reply.json()["id"]
    return message_id


def _round(client: httpx.Client, service: Service, url: str, turns: int) -> tuple[float, float]:
    """(server CPU µs per turn, median client latency ms) of one conversation of `turns` turns."""
    previous = _turn(client, url, None, 0)
    before = cpu_sample([service.pid])
    latencies = []
    for n in range(1, turns + 1):
        started = time.perf_counter()
        previous = _turn(client, url, previous, n)
        latencies.append(time.perf_counter() - started)
    cpu_ns = cpu_sample([service.pid]).sched_ns - before.sched_ns
    return cpu_ns / turns / 1000, statistics.median(latencies) * 1000


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.tracing", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6, help="rounds per server, interleaved (default 6)")
    parser.add_argument("--turns", type=int, default=200, help="continues per round (default 200)")
    args = parser.parse_args(argv)

    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("STATESTORE_", "OTEL_"))}
    with tempfile.TemporaryDirectory(prefix="bench-tracing-") as scratch:
        work = Path(scratch)
        echo_port = free_port()
        echo = Service(
            "echo",
            [python(), "-m", "statestore.cli", "echo-backend", "--port", str(echo_port)],
            env=base_env,
            log_dir=work,
            health_url=f"http://127.0.0.1:{echo_port}/v1/models",
        )
        services: dict[str, tuple[Service, str]] = {}
        try:
            echo.wait_healthy()
            for name, otel in (("off", {}), ("on", {"OTEL_TRACES_EXPORTER": "console"})):
                port = free_port()
                env = {
                    **base_env,
                    **otel,
                    "STATESTORE_DATABASE_URL": f"sqlite:///{work / name}.db",
                    "STATESTORE_UPSTREAM_URL": f"http://127.0.0.1:{echo_port}",
                    "STATESTORE_OWNER_SECRET": "bench-tracing-secret-0123456789",
                    "STATESTORE_LOG_LEVEL": "WARNING",
                }
                subprocess.run([python(), "-m", "statestore.cli", "migrate"], env=env, check=True, capture_output=True)
                service = Service(
                    name,
                    [python(), "-m", "statestore.cli", "serve", "--port", str(port)],
                    env=env,
                    log_dir=work,
                    health_url=f"http://127.0.0.1:{port}/healthz",
                )
                services[name] = (service, f"http://127.0.0.1:{port}")
                service.wait_healthy()
            results: dict[str, list[tuple[float, float]]] = {name: [] for name in services}
            with httpx.Client(timeout=30) as client:
                for service, url in services.values():  # a warm-up round each, not counted
                    _round(client, service, url, max(20, args.turns // 10))
                for _ in range(args.rounds):
                    for name, (service, url) in services.items():
                        results[name].append(_round(client, service, url, args.turns))
        finally:
            for service, _ in services.values():
                service.stop()
            echo.stop()

    cpu = {name: statistics.median(r[0] for r in rows) for name, rows in results.items()}
    latency = {name: statistics.median(r[1] for r in rows) for name, rows in results.items()}
    print(f"{args.rounds} rounds x {args.turns} threaded continues per server, interleaved (SQLite, echo backend)")
    print("tracing | server CPU per turn | client p50 latency")
    for name in results:
        print(f"{name:7} | {cpu[name]:12.0f} µs     | {latency[name]:8.2f} ms")
    print(f"on / off: CPU {cpu['on'] / cpu['off']:.2f}x, latency {latency['on'] / latency['off']:.2f}x")


if __name__ == "__main__":
    main()
