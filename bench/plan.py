"""What the orchestrator asks the load generator to do (`Plan`), and what it reports back (`Results`), as JSON."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

Arm = Literal["A", "R", "B", "C", "D"]
Mode = Literal["json", "stream"]
ARMS: tuple[Arm, ...] = ("A", "R", "B", "C", "D")
ARM_NAMES: dict[str, str] = {
    "A": "client → backend, full history",
    "R": "bare Python relay (raw ASGI + httpx), full history",
    "B": "statestore stateless relay, full history",
    "C": "statestore threaded continue, cache hot",
    "D": "statestore threaded continue, cache cold (PostgreSQL)",
}


class Target(BaseModel):
    name: str
    host: str = "127.0.0.1"
    port: int
    pids: list[int]  # the processes whose CPU and memory are this target's


class LatencyPlan(BaseModel):
    """Closed loop at concurrency 1, no backend delay: each arm's added latency and CPU per turn."""

    rounds: int
    batch: int  # measured requests per arm per round (after one warm-up request)
    modes: list[Mode]
    arms: list[Arm]


class OpenLoopPlan(BaseModel):
    """Requests at a fixed rate whatever the latency (no coordinated omission): latency under a steady load."""

    rounds: int
    seconds: float
    rates: dict[str, float]  # size label → requests per second
    delay_ms: int
    arms: list[Arm]


class SaturationPlan(BaseModel):
    """Closed loop at a high concurrency with a slow backend: turns per second per worker, worker CPU."""

    rounds: int
    warmup: float
    seconds: float
    concurrency: int
    delay_ms: int
    modes: list[Mode]
    sizes: list[str]
    arms: list[Arm]
    # Also run arms R, B and C at the first size (JSON) at these concurrencies: CPU per turn against turns in flight.
    sweep: list[int] = Field(default_factory=list)


class ThroughputPlan(BaseModel):
    """Arm C at one size against 1 and 2 workers, interleaved: throughput, scaling, every turn committed."""

    rounds: int
    warmup: float
    seconds: float
    concurrency: int
    delay_ms: int
    size: str


class SoakPlan(BaseModel):
    seconds: float
    rate: float
    sample_every: float
    size: str
    delay_ms: int


class Plan(BaseModel):
    mode: str
    backend: Target
    relay: Target | None
    s1: Target
    s2: Target | None
    redis_host: str
    redis_port: int
    redis_prefix: str
    database_dsn: str
    sizes: dict[str, int]  # label → bytes of a full request body
    latency: LatencyPlan | None = None
    open_loop: OpenLoopPlan | None = None
    saturation: SaturationPlan | None = None
    throughput: ThroughputPlan | None = None
    soak: SoakPlan | None = None


class Batch(BaseModel):
    phase: str
    arm: Arm
    size: str
    mode: Mode
    server: str
    concurrency: int = 1
    rate: float = 0.0
    n_ok: int = 0
    n_err: int = 0
    errors: list[str] = Field(default_factory=list)
    total_ms: list[float] = Field(default_factory=list)
    ttfb_ms: list[float] = Field(default_factory=list)
    window_s: float = 0.0
    cpu_ticks: int = 0  # utime+stime of the target's processes over the batch
    cpu_ns: int = 0  # se.sum_exec_runtime of their threads
    main_thread_ns: int = 0  # of their event-loop threads
    backend_ticks: int = 0
    backend_ns: int = 0
    request_bytes: int = 0  # HTTP request bytes (head and body) the client sent, over n_ok + n_err requests
    body_bytes: int = 0
    new_turn_bytes: int = 0
    rss_kb: int = 0
    machine_busy_ticks: int = 0  # every CPU's busy clock ticks over the batch, whoever used them (/proc/stat)
    machine_ticks: int = 0  # every CPU's clock ticks over the batch, busy or idle
    creates_inline: int = 0
    cache_dels: int = 0


class CommitCheck(BaseModel):
    phase: str
    turns_acknowledged: int  # threaded requests (creates and continues) that got their whole 200
    turns_in_database: int  # the growth of sum(threads.turn_count) over the same time


class SoakSample(BaseModel):
    t: float
    rss_kb: int
    turns: int
    cpu_ticks: int
    p50_ms: float
    p99_ms: float
    errors: int


class ThreadSizes(BaseModel):
    size: str
    create_body_bytes: int
    full_body_bytes: int
    turns_per_thread: int
    growth_per_turn: int


class Results(BaseModel):
    batches: list[Batch] = Field(default_factory=list)
    commit_checks: list[CommitCheck] = Field(default_factory=list)
    soak: list[SoakSample] = Field(default_factory=list)
    threads: list[ThreadSizes] = Field(default_factory=list)
    creates: int = 0
    started: float = 0.0
    finished: float = 0.0
