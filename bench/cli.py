"""`python -m bench [--quick | --soak]`: the statestore benchmark (see bench/README.md)."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from bench.harness import Options, run
from bench.plan import LatencyPlan, OpenLoopPlan, SaturationPlan, SoakPlan, ThroughputPlan
from bench.procs import REPO
from bench.relay import CLIENTS

KIB = 1024
SIZES = {"2k": 8 * KIB, "20k": 80 * KIB, "200k": 800 * KIB}  # ≈ tokens, at ~4 bytes of JSON per token
# The same sizes with a history of plain text (cheap to parse): the shape where a stateless relay costs least, so
# where a threaded continue's fixed cost shows most (bench/conversation.py, `shape_of`).
TEXT_SIZES = {"20k-text": 80 * KIB, "200k-text": 800 * KIB}
ALL_ARMS = ["A", "R", "B", "C", "D"]


def quick() -> Options:
    return Options(
        mode="quick",
        sizes=SIZES | TEXT_SIZES,
        plan_parts={
            "latency": LatencyPlan(rounds=2, batch=12, modes=["json", "stream"], arms=ALL_ARMS),
            "open_loop": OpenLoopPlan(rounds=1, seconds=1.0, rates={"2k": 50}, delay_ms=0, arms=ALL_ARMS),
            "saturation": SaturationPlan(
                rounds=1,
                warmup=0.4,
                seconds=1.2,
                concurrency=32,
                delay_ms=50,
                modes=["json"],
                sizes=list(SIZES),
                arms=["R", "B", "C", "D"],
                sweep=[4],
            ),
            "throughput": ThroughputPlan(rounds=1, warmup=0.8, seconds=2.0, concurrency=128, delay_ms=50, size="2k"),
        },
        profile_turns={"2k/json": 100, "200k/json": 30},  # add "200k/json/B" to profile arm B
    )


def full() -> Options:
    return Options(
        mode="full",
        sizes=SIZES | TEXT_SIZES,
        plan_parts={
            "latency": LatencyPlan(rounds=8, batch=40, modes=["json", "stream"], arms=ALL_ARMS),
            "open_loop": OpenLoopPlan(rounds=3, seconds=4.0, rates={"2k": 50, "200k": 10}, delay_ms=0, arms=ALL_ARMS),
            "saturation": SaturationPlan(
                rounds=2,
                warmup=1.0,
                seconds=4.0,
                concurrency=64,
                delay_ms=50,
                modes=["json", "stream"],
                sizes=list(SIZES),
                arms=["R", "B", "C", "D"],
                sweep=[4, 16],
            ),
            "throughput": ThroughputPlan(rounds=3, warmup=2.0, seconds=6.0, concurrency=128, delay_ms=50, size="2k"),
        },
        profile_turns={"2k/json": 400, "200k/json": 120, "2k/stream": 300, "200k/json/B": 60},
    )


def soak(seconds: float, rate: float) -> Options:
    return Options(
        mode="soak",
        sizes={"2k": SIZES["2k"]},
        plan_parts={"soak": SoakPlan(seconds=seconds, rate=rate, sample_every=10.0, size="2k", delay_ms=50)},
        with_relay=False,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--quick", action="store_true", help="a smaller run, under 2 minutes")
    which.add_argument("--soak", action="store_true", help="arm C at a steady rate for --soak-seconds: is RSS flat?")
    parser.add_argument("--soak-seconds", type=float, default=600.0)
    parser.add_argument("--soak-rate", type=float, default=30.0, help="turns per second during the soak")
    parser.add_argument("--reply-bytes", type=int, default=None, help="pad the echo backend's replies to ~N bytes")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--no-profile", action="store_true", help="skip the profiles")
    parser.add_argument("--relay-client", choices=CLIENTS, default=None, help="arm R's HTTP client (default aiohttp)")
    parser.add_argument("--readme", type=Path, default=REPO / "bench" / "README.md", help="where to write the figures")
    parser.add_argument("--no-readme", action="store_true", help="leave bench/README.md alone")
    parser.add_argument(
        "--only",
        help="comma-separated phases to run: latency, open_loop, saturation, throughput, profile (implies --no-readme)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="STATESTORE_X=VALUE",
        help="a statestore setting for the servers under test, e.g. STATESTORE_DATABASE_POOL_SIZE=20 (repeatable)",
    )
    args = parser.parse_args(argv)
    options = soak(args.soak_seconds, args.soak_rate) if args.soak else quick() if args.quick else full()
    options.reply_bytes = args.reply_bytes
    options.log_level = args.log_level
    options.readme = None if args.no_readme else args.readme
    options.command = " ".join(["python -m bench", shlex.join(sys.argv[1:] if argv is None else argv)]).strip()
    if args.no_profile:
        options.profile_turns = {}
    if args.relay_client:
        options.relay_client = args.relay_client
    for setting in args.set:
        name, _, value = setting.partition("=")
        if not name.startswith("STATESTORE_") or not _:
            parser.error(f"--set takes STATESTORE_NAME=VALUE, not {setting!r}")
        options.statestore_env[name] = value
    if args.only:
        phases = {p.strip() for p in args.only.split(",")}
        unknown = phases - {"latency", "open_loop", "saturation", "throughput", "profile"}
        if unknown:
            parser.error(f"unknown phases: {', '.join(sorted(unknown))}")
        options.plan_parts = {k: v for k, v in options.plan_parts.items() if k in phases}
        if "profile" not in phases:
            options.profile_turns = {}
        options.readme = None
    run(options)
