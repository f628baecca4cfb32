"""The orchestrator: scratch database and Redis prefix, the processes, the load generator, the profile, the report.

Process layout (each its own process, so each one's CPU is its own in /proc):

    load generator (bench.loadgen) ──► echo backend (bench.backend) ...................... arm A
                                   ──► bare relay (bench.relay) ──► backend .................. arm R
                                   ──► statestore serve, 1 worker ──► backend ............. arms B, C, D
                                   ──► statestore serve --workers 2 ──► backend ........... scaling
    statestore ──► PostgreSQL (scratch database, created and dropped here), Redis (own key prefix)
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import platform
import resource
import secrets
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import redis

from bench import profiling
from bench.plan import Plan, Results, Target
from bench.procs import (
    CLOCK_TICKS,
    REPO,
    Service,
    children,
    free_port,
    load_average,
    machine_busy_ticks,
    migrate,
    python,
    stat_ticks,
)
from bench.relay import default_client
from bench.report import Contention, Machine, ProfileRun, write_report

DEFAULT_PG = "postgresql://postgres@127.0.0.1:5432/postgres"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
OWNER_SECRET = "bench-owner-secret-0123456789abcdef"


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


@dataclass(slots=True)
class Options:
    mode: str  # quick | full | soak
    plan_parts: dict[str, object]
    sizes: dict[str, int]
    profile_turns: dict[str, int] = field(default_factory=dict)
    reply_bytes: int | None = None
    log_level: str = "INFO"
    readme: Path | None = REPO / "bench" / "README.md"
    command: str = "python -m bench"
    workers_for_scaling: int = 2
    with_relay: bool = True
    statestore_env: dict[str, str] = field(default_factory=dict)  # extra STATESTORE_* settings (`--set`)
    relay_client: str = field(default_factory=default_client)  # arm R's HTTP client: aiohttp, httpx or statestore


def code_id() -> str:
    """A short hash of the code under test: the commit and any uncommitted change to statestore/ and its deps."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, check=False).stdout
    diff = subprocess.run(
        ["git", "diff", "HEAD", "--", "statestore", "migrations", "pyproject.toml"],
        cwd=REPO,
        capture_output=True,
        check=False,
    ).stdout
    return hashlib.sha256(head + diff).hexdigest()[:10]


def machine() -> Machine:
    model = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True, check=False
    ).stdout.strip()
    return Machine(
        cores=os.cpu_count() or 0,
        cpu_model=model,
        kernel=platform.release(),
        python=platform.python_version(),
        date=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        commit=commit + (" (work tree with uncommitted changes)" if dirty else ""),
        code_at_start=code_id(),
    )


async def _pg_admin(admin_dsn: str, statement: str) -> None:
    connection = await asyncpg.connect(admin_dsn, timeout=10)
    try:
        await connection.execute(statement)
    finally:
        await connection.close()


@contextlib.contextmanager
def scratch_database(admin_dsn: str) -> Iterator[str]:
    name = f"statestore_bench_{secrets.token_hex(5)}"
    asyncio.run(_pg_admin(admin_dsn, f'CREATE DATABASE "{name}"'))
    base, _, _ = admin_dsn.rpartition("/")
    try:
        yield f"{base}/{name}"
    finally:
        asyncio.run(_pg_admin(admin_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        log(f"dropped database {name}")


@contextlib.contextmanager
def redis_prefix(url: str) -> Iterator[str]:
    prefix = f"ssbench:{secrets.token_hex(5)}:"
    try:
        yield prefix
    finally:
        client = redis.Redis.from_url(url)
        try:
            deleted = 0
            batch: list[bytes] = []
            for key in client.scan_iter(match=prefix + "*", count=1000):
                batch.append(key)
                if len(batch) == 1000:
                    deleted += int(client.delete(*batch))
                    batch = []
            if batch:
                deleted += int(client.delete(*batch))
            log(f"deleted {deleted} Redis keys under {prefix}")
        finally:
            client.close()


def _statestore_env(database: str, redis_url: str, prefix: str, upstream: str, log_level: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STATESTORE_")}
    env.update(
        {
            "STATESTORE_DATABASE_URL": database,
            "STATESTORE_REDIS_URL": redis_url,
            "STATESTORE_REDIS_PREFIX": prefix,
            "STATESTORE_UPSTREAM_URL": upstream,
            "STATESTORE_OWNER_SECRET": OWNER_SECRET,
            # Threads made early in a long run must still be live at its end.
            "STATESTORE_DEFAULT_TTL_SECONDS": "7200",
            "STATESTORE_LOG_LEVEL": log_level,
        }
    )
    return env


def run(options: Options) -> Path:
    admin_dsn = os.environ.get("STATESTORE_BENCH_PG", DEFAULT_PG)
    redis_url = os.environ.get("STATESTORE_BENCH_REDIS", DEFAULT_REDIS)
    redis_location = urlsplit(redis_url)
    host = redis_location.hostname or "127.0.0.1"
    port = redis_location.port or 6379
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"statestore-bench-{time.strftime('%Y%m%d-%H%M%S')}"
    work.mkdir(parents=True)
    log(f"mode {options.mode}; logs and raw results in {work}")
    about = machine()
    services: list[Service] = []
    started = time.monotonic()
    with scratch_database(admin_dsn) as database, redis_prefix(redis_url) as prefix:
        try:
            backend_port = free_port()
            upstream = f"http://127.0.0.1:{backend_port}"
            env = _statestore_env(database, redis_url, prefix, upstream, options.log_level) | options.statestore_env
            migrate(env)
            backend_argv = [python(), "-m", "bench.backend", "--port", str(backend_port)]
            if options.reply_bytes:
                backend_argv += ["--reply-bytes", str(options.reply_bytes)]
            backend = Service("backend", backend_argv, env=env, log_dir=work, health_url=f"{upstream}/v1/models")
            services.append(backend)
            relay: Service | None = None
            relay_port = 0
            if options.with_relay:
                relay_port = free_port()
                relay = Service(
                    "relay",
                    [
                        python(),
                        "-m",
                        "bench.relay",
                        "--port",
                        str(relay_port),
                        "--upstream",
                        upstream,
                        "--client",
                        options.relay_client,
                    ],
                    env=env,
                    log_dir=work,
                    health_url=f"http://127.0.0.1:{relay_port}/v1/models",
                )
                services.append(relay)
            s1_port = free_port()
            s1 = Service(
                "statestore-1w",
                [python(), "-m", "statestore.cli", "serve", "--port", str(s1_port), "--workers", "1"],
                env=env,
                log_dir=work,
                health_url=f"http://127.0.0.1:{s1_port}/healthz",
            )
            services.append(s1)
            s2: Service | None = None
            s2_port = 0
            if "throughput" in options.plan_parts:
                s2_port = free_port()
                s2 = Service(
                    f"statestore-{options.workers_for_scaling}w",
                    [
                        python(),
                        "-m",
                        "statestore.cli",
                        "serve",
                        "--port",
                        str(s2_port),
                        "--workers",
                        str(options.workers_for_scaling),
                    ],
                    env=env,
                    log_dir=work,
                    health_url=f"http://127.0.0.1:{s2_port}/healthz",
                )
                services.append(s2)
            for service in services:
                service.wait_healthy()
            plan = Plan(
                mode=options.mode,
                backend=Target(name="backend", port=backend_port, pids=[backend.pid]),
                relay=Target(name="relay", port=relay_port, pids=[relay.pid]) if relay is not None else None,
                s1=Target(name="statestore-1w", port=s1_port, pids=s1.worker_pids(1)),
                s2=(
                    Target(name=s2.name, port=s2_port, pids=s2.worker_pids(options.workers_for_scaling))
                    if s2 is not None
                    else None
                ),
                redis_host=host,
                redis_port=port,
                redis_prefix=prefix,
                database_dsn=database,
                sizes=options.sizes,
                **options.plan_parts,
            )
            plan_path, results_path = work / "plan.json", work / "results.json"
            plan_path.write_text(plan.model_dump_json(indent=1))
            log(f"processes up in {time.monotonic() - started:.1f}s; starting the load generator")
            ours = [pid for service in services for pid in [service.pid, *children(service.pid)]]
            busy_before, ours_before = machine_busy_ticks(), sum(stat_ticks(pid) for pid in ours)
            children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
            loads: list[float] = []
            sampling = threading.Event()

            def sample_load() -> None:
                while not sampling.wait(5.0):
                    loads.append(load_average())

            sampler = threading.Thread(target=sample_load, daemon=True)
            sampler.start()
            loadgen = subprocess.run(
                [python(), "-m", "bench.loadgen", str(plan_path), str(results_path)], cwd=REPO, check=False
            )
            sampling.set()
            busy_after = machine_busy_ticks()
            children_after = resource.getrusage(resource.RUSAGE_CHILDREN)
            loadgen_ticks = round(
                (
                    children_after.ru_utime
                    + children_after.ru_stime
                    - children_before.ru_utime
                    - children_before.ru_stime
                )
                * CLOCK_TICKS
            )
            ours_ticks = sum(stat_ticks(pid) for pid in ours) - ours_before + loadgen_ticks
            span = busy_after[1] - busy_before[1]
            cores = os.cpu_count() or 1
            contention = Contention(
                load_average=sum(loads) / len(loads) if loads else load_average(),
                busy_cores=cores * (busy_after[0] - busy_before[0]) / span if span else 0.0,
                benchmark_cores=cores * ours_ticks / span if span else 0.0,
            )
            if loadgen.returncode != 0:
                tails = "\n".join(f"--- {s.name}\n{s.log_tail(15)}" for s in services)
                raise RuntimeError(f"the load generator failed ({loadgen.returncode})\n{tails}")
            results = Results.model_validate_json(results_path.read_bytes())
            profiles = _profile(options, env, work) if options.profile_turns else []
            for service in services:
                service.stop()
            services.clear()
        finally:
            for service in services:
                service.stop()
    elapsed = time.monotonic() - started
    about.code_at_end = code_id()
    about.relay_client = options.relay_client if options.with_relay else ""
    report = write_report(
        mode=options.mode,
        command=options.command,
        machine=about,
        plan=plan,
        results=results,
        profiles=profiles,
        elapsed_s=elapsed,
        readme=options.readme,
        log_level=options.log_level,
        contention=contention,
    )
    (work / "report.md").write_text(report)
    log(
        f"done in {elapsed:.0f}s; report in {work / 'report.md'}" + (f" and {options.readme}" if options.readme else "")
    )
    return work


def _profile(options: Options, env: dict[str, str], work: Path) -> list[ProfileRun]:
    port = free_port()
    server = Service(
        "statestore-profiled",
        [python(), "-m", "bench.profiling", "serve", "--port", str(port)],
        env=env,
        log_dir=work,
        health_url=f"http://127.0.0.1:{port}/healthz",
    )
    runs: list[ProfileRun] = []
    try:
        server.wait_healthy()
        for key, turns in options.profile_turns.items():
            size, mode, arm = [*key.split("/"), "C"][:3]
            out = work / f"profile-{arm}-{size}-{mode}.json"
            wall = asyncio.run(
                profiling.profile_continues(
                    port,
                    size_bytes=options.sizes[size],
                    stream=mode == "stream",
                    turns=turns,
                    warmup=max(10, turns // 5),
                    out=out,
                    arm=arm,
                )
            )
            what = "continue (C)" if arm == "C" else "stateless relay (B)"
            summary = profiling.summarize(f"{what} {size} {mode}", out, turns, wall)
            runs.append(ProfileRun(size=size, mode=mode, path=str(out), summary=summary))
            log(f"profiled {turns} turns of {arm} at {size} ({mode}): {summary.samples} samples")
    finally:
        server.stop()
    return runs
