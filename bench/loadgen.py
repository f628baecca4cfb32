"""The load generator: a process of its own that runs a `Plan` against the servers and writes `Results`.

    python -m bench.loadgen plan.json results.json

Arms (docs/protocol.md §2 for C and D):
  A  client → echo backend with the full history
  R  client → bare relay (bench/relay.py) → backend, full history
  B  client → statestore, no `thread` field (stateless relay), full history
  C  client → statestore, `thread: continue` with only the new turn; the thread's history is in Redis
  D  as C, but this thread's Redis keys are deleted just before the request, so statestore reads PostgreSQL

Each continue of C and D is a genuine continue of a thread of the target size: threads are made by a create with
the full history, continued a few times (their growth is bounded, see conversation.py) and then retired. Threads
are made between measured batches, never inside one unless a pool runs dry (counted as `creates_inline`).

CPU of a batch is read from /proc for the target's processes before and after it (procs.py); latencies are taken
on the client from the write of the request to the first body byte and to the end of the response.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import asyncpg

from bench import conversation as conv
from bench.plan import Arm, Batch, CommitCheck, Mode, Plan, Results, SoakSample, Target, ThreadSizes
from bench.procs import CpuSample, cpu_sample, machine_busy_ticks, rss_kb
from bench.rawhttp import ConnectionClosed, HttpConnection, RedisConnection, Reply, render_request
from bench.stats import percentile

T = TypeVar("T")
CREATE_CONCURRENCY = 16
_BASE_HEADERS = [("content-type", "application/json"), ("x-api-key", "bench-key"), ("anthropic-version", "2023-06-01")]


def log(message: str) -> None:
    print(f"[loadgen {time.strftime('%H:%M:%S')}] {message}", flush=True)


@dataclass(slots=True)
class ThreadState:
    thread_id: str
    previous_id: str
    used: int = 0


@dataclass(slots=True)
class Outcome:
    ok: bool
    reply: Reply | None
    request_bytes: int
    body_bytes: int
    new_turn_bytes: int
    error: str = ""
    created_inline: bool = False
    cache_del: bool = False


class Slot:
    """A client's connection to one target, and (for arm D) its own Redis connection."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.conn: HttpConnection | None = None
        self.redis: RedisConnection | None = None

    async def http(self) -> HttpConnection:
        if self.conn is None or self.conn.closed:
            self.conn = await HttpConnection.open(self.target.host, self.target.port)
        return self.conn

    async def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        if self.redis is not None:
            await self.redis.aclose()


class LoadGenerator:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.results = Results()
        self.conversations = {
            label: conv.build_conversation(size, shape=conv.shape_of(label)) for label, size in plan.sizes.items()
        }
        self.full_bodies = {
            (label, mode): conv.FullBody(c, stream=mode == "stream")
            for label, c in self.conversations.items()
            for mode in ("json", "stream")
        }
        self.create_bodies = {label: conv.create_body(c) for label, c in self.conversations.items()}
        self.pools: dict[str, deque[ThreadState]] = {label: deque() for label in plan.sizes}
        self.counter = 0
        self.threaded_ok = 0
        for label, c in self.conversations.items():
            full, _ = self.full_bodies[(label, "json")].render(0)
            self.results.threads.append(
                ThreadSizes(
                    size=label,
                    create_body_bytes=len(self.create_bodies[label]),
                    full_body_bytes=len(full),
                    turns_per_thread=c.turns_per_thread,
                    growth_per_turn=c.growth_per_turn,
                )
            )

    # -- requests ----------------------------------------------------------------------------------------------

    def _next(self) -> int:
        self.counter += 1
        return self.counter

    def _headers(self, delay_ms: int, threaded: bool) -> list[tuple[str, str]]:
        headers = [*_BASE_HEADERS, ("bench-delay-ms", str(delay_ms))]
        if threaded:
            headers.append(("anthropic-beta", conv.THREADS_BETA))
        return headers

    def _keys(self, thread_id: str) -> tuple[bytes, bytes]:
        tagged = f"{self.plan.redis_prefix}{{{thread_id}}}"
        return f"{tagged}:h".encode(), f"{tagged}:n".encode()

    async def _create(self, slot: Slot, size: str) -> ThreadState:
        body = self.create_bodies[size]
        raw = render_request(slot.target.host, slot.target.port, "/v1/messages", self._headers(0, True), body)
        reply = await (await slot.http()).request(raw)
        message_id = reply.message_id()
        if reply.status != 200 or message_id is None or reply.thread_id is None:
            raise RuntimeError(f"create failed with {reply.status}: {reply.head[:300]!r}")
        self.results.creates += 1
        self.threaded_ok += 1
        return ThreadState(reply.thread_id, message_id)

    async def top_up(self, size: str, count: int) -> None:
        """Make threads of `size` until its pool holds `count` (through the 1-worker statestore, no delay)."""
        pool = self.pools[size]
        missing = count - len(pool)
        if missing <= 0:
            return
        started = time.monotonic()
        slots = [Slot(self.plan.s1) for _ in range(min(CREATE_CONCURRENCY, missing))]
        remaining = missing

        async def worker(slot: Slot) -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                pool.append(await self._create(slot, size))

        try:
            await asyncio.gather(*(worker(slot) for slot in slots))
        finally:
            for slot in slots:
                await slot.close()
        log(f"made {missing} threads of {size} in {time.monotonic() - started:.1f}s (pool {len(pool)})")

    async def one(self, arm: Arm, slot: Slot, size: str, mode: Mode, delay_ms: int) -> Outcome:
        """One request of `arm`; for C and D one continue of a pooled thread (made on the spot if none is left)."""
        n = self._next()
        host, port = slot.target.host, slot.target.port
        if arm in ("A", "R", "B"):
            body, turn_bytes = self.full_bodies[(size, mode)].render(n)
            raw = render_request(host, port, "/v1/messages", self._headers(delay_ms, False), body)
            try:
                reply = await (await slot.http()).request(raw)
            except (ConnectionClosed, OSError) as exc:
                return Outcome(False, None, len(raw), len(body), turn_bytes, error=f"{type(exc).__name__}: {exc}")
            ok = reply.status == 200 and (mode == "json" or reply.complete_stream())
            return Outcome(ok, reply, len(raw), len(body), turn_bytes, error="" if ok else _describe(reply))

        pool = self.pools[size]
        created = False
        if pool:
            state = pool.popleft()
        else:
            try:
                state = await self._create(slot, size)
            except (RuntimeError, ConnectionClosed, OSError) as exc:
                return Outcome(False, None, 0, 0, 0, f"inline create: {exc}", True, False)
            created = True
        if arm == "D":
            if slot.redis is None:
                slot.redis = await RedisConnection.open(self.plan.redis_host, self.plan.redis_port)
            await slot.redis.integer(b"DEL", *self._keys(state.thread_id))
        body, turn_bytes = conv.continue_body(state.previous_id, n, stream=mode == "stream")
        raw = render_request(host, port, "/v1/messages", self._headers(delay_ms, True), body)
        try:
            reply = await (await slot.http()).request(raw)
        except (ConnectionClosed, OSError) as exc:
            pool.append(state)
            return Outcome(
                False, None, len(raw), len(body), turn_bytes, f"{type(exc).__name__}: {exc}", created, arm == "D"
            )
        message_id = reply.message_id()
        ok = reply.status == 200 and message_id is not None and (mode == "json" or reply.complete_stream())
        if ok:
            assert message_id is not None
            self.threaded_ok += 1
            state.previous_id = message_id
            state.used += 1
            if state.used < self.conversations[size].turns_per_thread:
                pool.append(state)
        else:
            pool.append(state)
        return Outcome(ok, reply, len(raw), len(body), turn_bytes, "" if ok else _describe(reply), created, arm == "D")

    # -- measurement -------------------------------------------------------------------------------------------

    def target_of(self, arm: Arm, statestore: Target | None = None) -> Target:
        if arm == "A":
            return self.plan.backend
        if arm == "R":
            assert self.plan.relay is not None
            return self.plan.relay
        return statestore or self.plan.s1

    def _snapshot(self, target: Target) -> tuple[CpuSample, CpuSample, tuple[int, int]]:
        # Arm A has no server of its own: its CPU columns stay 0 and the backend's are reported separately.
        own = cpu_sample(target.pids) if target is not self.plan.backend else CpuSample(0, 0, 0)
        return own, cpu_sample(self.plan.backend.pids), machine_busy_ticks()

    def _account(self, batch: Batch, outcome: Outcome, *, latency_from_ns: int | None = None) -> None:
        batch.request_bytes += outcome.request_bytes
        batch.body_bytes += outcome.body_bytes
        batch.new_turn_bytes += outcome.new_turn_bytes
        batch.creates_inline += outcome.created_inline
        batch.cache_dels += outcome.cache_del
        if outcome.ok and outcome.reply is not None:
            batch.n_ok += 1
            start = outcome.reply.sent_ns if latency_from_ns is None else latency_from_ns
            batch.total_ms.append((outcome.reply.done_ns - start) / 1e6)
            batch.ttfb_ms.append((outcome.reply.first_byte_ns - start) / 1e6)
        else:
            batch.n_err += 1
            if len(batch.errors) < 5:
                batch.errors.append(outcome.error[:300])

    def _close_batch(
        self, batch: Batch, target: Target, before: tuple[CpuSample, CpuSample, tuple[int, int]], started: float
    ) -> None:
        after = self._snapshot(target)
        batch.window_s = time.perf_counter() - started
        batch.cpu_ticks = after[0].ticks - before[0].ticks
        batch.cpu_ns = after[0].sched_ns - before[0].sched_ns
        batch.main_thread_ns = after[0].main_thread_ns - before[0].main_thread_ns
        batch.backend_ticks = after[1].ticks - before[1].ticks
        batch.backend_ns = after[1].sched_ns - before[1].sched_ns
        batch.rss_kb = rss_kb(target.pids)
        batch.machine_busy_ticks = after[2][0] - before[2][0]
        batch.machine_ticks = after[2][1] - before[2][1]
        self.results.batches.append(batch)

    async def sequential(self, phase: str, arm: Arm, size: str, mode: Mode, n: int, delay_ms: int) -> Batch:
        """`n` requests one after another on one connection, after one unmeasured warm-up request."""
        target = self.target_of(arm)
        slot = Slot(target)
        batch = Batch(phase=phase, arm=arm, size=size, mode=mode, server=target.name)
        try:
            await self.one(arm, slot, size, mode, delay_ms)
            before = self._snapshot(target)
            started = time.perf_counter()
            for _ in range(n):
                self._account(batch, await self.one(arm, slot, size, mode, delay_ms))
            self._close_batch(batch, target, before, started)
        finally:
            await slot.close()
        return batch

    async def closed_loop(
        self,
        phase: str,
        arm: Arm,
        size: str,
        mode: Mode,
        *,
        concurrency: int,
        warmup: float,
        seconds: float,
        delay_ms: int,
        statestore: Target | None = None,
    ) -> Batch:
        """`concurrency` clients, each sending its next request as soon as the last one ended; what completes in
        the window after `warmup` is counted."""
        target = self.target_of(arm, statestore)
        batch = Batch(phase=phase, arm=arm, size=size, mode=mode, server=target.name, concurrency=concurrency)
        slots = [Slot(target) for _ in range(concurrency)]
        counting = False
        stop = False

        async def client(slot: Slot) -> None:
            while not stop:
                outcome = await self.one(arm, slot, size, mode, delay_ms)
                if counting:
                    self._account(batch, outcome)

        try:
            await asyncio.gather(*(slot.http() for slot in slots))
            tasks = [asyncio.create_task(client(slot)) for slot in slots]
            await asyncio.sleep(warmup)
            before = self._snapshot(target)
            started = time.perf_counter()
            counting = True
            await asyncio.sleep(seconds)
            counting = False
            self._close_batch(batch, target, before, started)
            stop = True
            await asyncio.gather(*tasks)
        finally:
            for slot in slots:
                await slot.close()
        return batch

    async def open_loop(
        self,
        phase: str,
        arm: Arm,
        size: str,
        mode: Mode,
        *,
        rate: float,
        seconds: float,
        delay_ms: int,
        statestore: Target | None = None,
        on_outcome: Callable[[Outcome, int], None] | None = None,
        max_in_flight: int = 256,
    ) -> Batch:
        """Requests sent at `rate` per second on schedule, on whichever connection is free (a new one when none is);
        latency counts from the scheduled time, so a slow server cannot slow the offered load down."""
        target = self.target_of(arm, statestore)
        batch = Batch(phase=phase, arm=arm, size=size, mode=mode, server=target.name, rate=rate)
        idle = [Slot(target) for _ in range(max(4, min(64, int(rate * 0.02) + 4)))]
        every: list[Slot] = list(idle)
        await asyncio.gather(*(slot.http() for slot in idle))
        loop = asyncio.get_running_loop()
        total = int(rate * seconds)
        pending: set[asyncio.Task[None]] = set()

        async def fire(scheduled_ns: int) -> None:
            if len(pending) > max_in_flight:
                # The server fell this far behind: count the request as failed rather than pile up without bound.
                self._account(batch, Outcome(False, None, 0, 0, 0, f"over {max_in_flight} requests in flight"))
                if on_outcome is not None:
                    on_outcome(Outcome(False, None, 0, 0, 0, "overload"), scheduled_ns)
                return
            slot = idle.pop() if idle else Slot(target)
            if slot not in every:
                every.append(slot)
            outcome = await self.one(arm, slot, size, mode, delay_ms)
            self._account(batch, outcome, latency_from_ns=scheduled_ns)
            if on_outcome is not None:
                on_outcome(outcome, scheduled_ns)
            idle.append(slot)

        try:
            before = self._snapshot(target)
            started = time.perf_counter()
            start_ns = time.perf_counter_ns() + 1_000_000
            for i in range(total):
                due_ns = start_ns + int(i * 1e9 / rate)
                wait = (due_ns - time.perf_counter_ns()) / 1e9
                if wait > 0:
                    await asyncio.sleep(wait)
                task = loop.create_task(fire(due_ns))
                pending.add(task)
                task.add_done_callback(pending.discard)
            while pending:
                await asyncio.gather(*list(pending))
            self._close_batch(batch, target, before, started)
        finally:
            for slot in every:
                await slot.close()
        return batch

    # -- phases ------------------------------------------------------------------------------------------------

    async def latency_phase(self) -> None:
        plan = self.plan.latency
        if plan is None:
            return
        threaded = [arm for arm in plan.arms if arm in ("C", "D")]
        for size, c in self.conversations.items():
            turns = plan.rounds * (plan.batch + 1) * len(plan.modes) * len(threaded)
            await self.top_up(size, math.ceil(turns / c.turns_per_thread) + 2)
        combos = [(size, mode) for size in self.plan.sizes for mode in plan.modes]
        for round_no in range(plan.rounds):
            for size, mode in _rotate(combos, round_no):
                for arm in _rotate(plan.arms, round_no):
                    batch = await self.sequential("latency", arm, size, mode, plan.batch, delay_ms=0)
                    if batch.n_err:
                        log(f"latency {arm} {size} {mode}: {batch.n_err} errors, e.g. {batch.errors[:1]}")
            log(f"latency round {round_no + 1}/{plan.rounds} done")

    async def open_loop_phase(self) -> None:
        plan = self.plan.open_loop
        if plan is None:
            return
        threaded = [arm for arm in plan.arms if arm in ("C", "D")]
        for round_no in range(plan.rounds):
            for size, rate in plan.rates.items():
                c = self.conversations[size]
                turns = rate * plan.seconds * len(threaded) * 1.2
                await self.top_up(size, math.ceil(turns / c.turns_per_thread) + 4)
                for arm in _rotate(plan.arms, round_no):
                    batch = await self.open_loop(
                        "open", arm, size, "json", rate=rate, seconds=plan.seconds, delay_ms=plan.delay_ms
                    )
                    log(
                        f"open loop {arm} {size} at {rate:g}/s: p50 {percentile(batch.total_ms, 50):.2f} ms, "
                        f"p99 {percentile(batch.total_ms, 99):.2f} ms, errors {batch.n_err}"
                    )

    def _rate_guess(self, arm: Arm, size: str, concurrency: int, delay_ms: int, workers: int = 1) -> float:
        """An upper estimate of the turns per second a window will see, to make enough threads before it."""
        cpu = [b for b in self.results.batches if b.arm == arm and b.size == size and b.n_ok and b.cpu_ns]
        ceiling = concurrency / max(delay_ms / 1000, 0.002)
        if not cpu:
            return ceiling
        per_turn_s = sum(b.cpu_ns for b in cpu) / sum(b.n_ok for b in cpu) / 1e9
        return min(ceiling, 1.6 * workers / per_turn_s)

    async def saturation_phase(self) -> None:
        plan = self.plan.saturation
        if plan is None:
            return
        for round_no in range(plan.rounds):
            for size in _rotate(plan.sizes, round_no):
                c = self.conversations[size]
                for mode in plan.modes:
                    for arm in _rotate(plan.arms, round_no):
                        if arm in ("C", "D"):
                            rate = self._rate_guess(arm, size, plan.concurrency, plan.delay_ms)
                            turns = rate * (plan.warmup + plan.seconds + 0.5)
                            await self.top_up(size, math.ceil(turns / c.turns_per_thread) + plan.concurrency)
                        batch = await self.closed_loop(
                            "saturation",
                            arm,
                            size,
                            mode,
                            concurrency=plan.concurrency,
                            warmup=plan.warmup,
                            seconds=plan.seconds,
                            delay_ms=plan.delay_ms,
                        )
                        cpu_pct = 100 * batch.cpu_ns / 1e9 / batch.window_s / max(1, len(self.target_of(arm).pids))
                        log(
                            f"saturation {arm} {size} {mode}: {batch.n_ok / batch.window_s:.0f} turns/s, "
                            f"worker CPU {cpu_pct:.0f}%, errors {batch.n_err}, inline creates {batch.creates_inline}"
                        )
        size = plan.sizes[0]
        c = self.conversations[size]
        for round_no in range(plan.rounds):
            for concurrency in _rotate(plan.sweep, round_no):
                for arm in _rotate([a for a in plan.arms if a in ("R", "B", "C")], round_no):
                    if arm == "C":
                        rate = self._rate_guess(arm, size, concurrency, plan.delay_ms)
                        turns = rate * (plan.warmup + plan.seconds + 0.5)
                        await self.top_up(size, math.ceil(turns / c.turns_per_thread) + concurrency)
                    batch = await self.closed_loop(
                        "sweep",
                        arm,
                        size,
                        "json",
                        concurrency=concurrency,
                        warmup=plan.warmup,
                        seconds=plan.seconds,
                        delay_ms=plan.delay_ms,
                    )
                    log(
                        f"sweep {arm} {size} at {concurrency} in flight: "
                        f"{batch.cpu_ns / 1e3 / max(1, batch.n_ok):.0f} us CPU/turn, errors {batch.n_err}"
                    )

    async def _turns_in_db(self) -> int:
        connection = await asyncpg.connect(self.plan.database_dsn)
        try:
            value = await connection.fetchval("SELECT coalesce(sum(turn_count), 0) FROM threads")
        finally:
            await connection.close()
        return int(value)

    async def throughput_phase(self) -> None:
        plan = self.plan.throughput
        if plan is None:
            return
        servers = [self.plan.s1] + ([self.plan.s2] if self.plan.s2 is not None else [])
        c = self.conversations[plan.size]
        for round_no in range(plan.rounds):
            for server in _rotate(servers, round_no):
                workers = len(server.pids)
                rate = self._rate_guess("C", plan.size, plan.concurrency, plan.delay_ms, workers)
                turns = rate * (plan.warmup + plan.seconds + 0.5)
                await self.top_up(plan.size, math.ceil(turns / c.turns_per_thread) + plan.concurrency)
                in_db = await self._turns_in_db()
                acknowledged = self.threaded_ok
                batch = await self.closed_loop(
                    "throughput",
                    "C",
                    plan.size,
                    "json",
                    concurrency=plan.concurrency,
                    warmup=plan.warmup,
                    seconds=plan.seconds,
                    delay_ms=plan.delay_ms,
                    statestore=server,
                )
                self.results.commit_checks.append(
                    CommitCheck(
                        phase=f"throughput {server.name} round {round_no + 1}",
                        turns_acknowledged=self.threaded_ok - acknowledged,
                        turns_in_database=await self._turns_in_db() - in_db,
                    )
                )
                cpu_pct = 100 * batch.cpu_ns / 1e9 / batch.window_s / workers
                log(
                    f"throughput C {plan.size} on {server.name}: {batch.n_ok / batch.window_s:.0f} turns/s, "
                    f"CPU {cpu_pct:.0f}% per worker, errors {batch.n_err}, inline creates {batch.creates_inline}"
                )

    async def soak_phase(self) -> None:
        plan = self.plan.soak
        if plan is None:
            return
        # No threads made ahead: the steady workload is conversations that start (a create with the full history)
        # and go on for their growth budget of continues, so creates are part of it from the first second to the last.
        target = self.plan.s1
        window: list[float] = []
        errors = 0

        def seen(outcome: Outcome, scheduled_ns: int) -> None:
            nonlocal errors
            if outcome.ok and outcome.reply is not None:
                window.append((outcome.reply.done_ns - scheduled_ns) / 1e6)
            else:
                errors += 1

        async def sampler() -> None:
            nonlocal errors
            started = time.monotonic()
            last = cpu_sample(target.pids)
            while True:
                await asyncio.sleep(plan.sample_every)
                now = cpu_sample(target.pids)
                sample = SoakSample(
                    t=time.monotonic() - started,
                    rss_kb=rss_kb(target.pids),
                    turns=len(window),
                    cpu_ticks=now.ticks - last.ticks,
                    p50_ms=percentile(window, 50),
                    p99_ms=percentile(window, 99),
                    errors=errors,
                )
                self.results.soak.append(sample)
                log(
                    f"soak t={sample.t:.0f}s rss={sample.rss_kb / 1024:.1f} MiB turns={sample.turns} "
                    f"p50={sample.p50_ms:.2f} ms p99={sample.p99_ms:.2f} ms errors={errors}"
                )
                window.clear()
                errors = 0
                last = now

        task = asyncio.create_task(sampler())
        in_db = await self._turns_in_db()
        acknowledged = self.threaded_ok
        try:
            await self.open_loop(
                "soak",
                "C",
                plan.size,
                "json",
                rate=plan.rate,
                seconds=plan.seconds,
                delay_ms=plan.delay_ms,
                on_outcome=seen,
            )
        finally:
            task.cancel()
        self.results.commit_checks.append(
            CommitCheck(
                phase="soak",
                turns_acknowledged=self.threaded_ok - acknowledged,
                turns_in_database=await self._turns_in_db() - in_db,
            )
        )

    async def check_cache_layout(self) -> None:
        """Arm D deletes `<prefix>{<thread>}:h` and `:n`; make sure those are the keys statestore writes."""
        size = next(iter(self.plan.sizes))
        await self.top_up(size, 1)
        state = self.pools[size][0]
        redis = await RedisConnection.open(self.plan.redis_host, self.plan.redis_port)
        try:
            found = await redis.integer(b"EXISTS", *self._keys(state.thread_id))
        finally:
            await redis.aclose()
        if found != 2:
            raise RuntimeError(f"statestore's cache keys are not {self._keys(state.thread_id)}: arm D would be hot")

    async def run(self) -> Results:
        self.results.started = time.time()
        at_start = await self._turns_in_db()
        await self.check_cache_layout()
        phases: list[Callable[[], Awaitable[None]]] = [
            self.latency_phase,
            self.open_loop_phase,
            self.saturation_phase,
            self.throughput_phase,
            self.soak_phase,
        ]
        for phase in phases:
            await phase()
        whole = CommitCheck(
            phase="whole run",
            turns_acknowledged=self.threaded_ok,
            turns_in_database=await self._turns_in_db() - at_start,
        )
        self.results.commit_checks.insert(0, whole)
        self.results.finished = time.time()
        return self.results


def _describe(reply: Reply) -> str:
    return f"HTTP {reply.status}: {reply.head[:200]!r}"


def _rotate(items: list[T], by: int) -> list[T]:
    if not items:
        return items
    by %= len(items)
    return items[by:] + items[:by]


def main() -> None:
    plan_path, results_path = Path(sys.argv[1]), Path(sys.argv[2])
    plan = Plan.model_validate_json(plan_path.read_bytes())
    import uvloop

    results = uvloop.run(LoadGenerator(plan).run())
    results_path.write_text(results.model_dump_json())


if __name__ == "__main__":
    main()
