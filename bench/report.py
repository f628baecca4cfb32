"""Figures from the raw results, the issue's targets judged against them, and the markdown for bench/README.md.

Definitions (bench/README.md repeats them):
- added latency of arm X at a size and mode = percentile(X) - percentile(A), each over all of its interleaved
  batches: p50 - p50 and p99 - p99 of the time from writing the request to the end of the response (TTFB: to its
  first body byte);
- CPU per turn = (utime + stime of the arm's server processes over its batches) / turns, from /proc/<pid>/stat
  ("stat"); "sched" is the same from the threads' se.sum_exec_runtime (ns), the precise cross-check;
- turns/s per worker at saturation = turns completed in the window / window / workers, closed loop at a high
  concurrency against a backend that takes 50 ms, so many turns are in flight.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from bench.plan import ARM_NAMES, Batch, Plan, Results
from bench.procs import CLOCK_TICKS
from bench.profiling import ProfileSummary
from bench.stats import percentile


@dataclass(slots=True)
class Machine:
    cores: int
    cpu_model: str
    kernel: str
    python: str
    date: str
    commit: str
    code_at_start: str = ""  # harness.code_id(): the commit plus uncommitted changes of statestore/
    code_at_end: str = ""
    relay_client: str = ""


@dataclass(frozen=True, slots=True)
class Contention:
    """How busy the machine was while the load generator ran: this benchmark's processes and everyone else's."""

    load_average: float
    busy_cores: float
    benchmark_cores: float  # servers, backend, relay and load generator (not PostgreSQL or Redis, which are shared)


@dataclass(frozen=True, slots=True)
class ProfileRun:
    size: str
    mode: str
    path: str
    summary: ProfileSummary


@dataclass(slots=True)
class Figures:
    """One arm at one size and mode, in one phase, all its batches together."""

    n_ok: int
    n_err: int
    total: list[float]
    ttfb: list[float]
    cpu_us_stat: float  # per turn
    cpu_us_sched: float
    main_share: float  # of sched time, on the event-loop threads
    backend_us: float  # backend CPU per request (context)
    window_s: float
    workers: int
    request_bytes: float
    body_bytes: float
    new_turn_bytes: float
    rss_mib: float
    creates_inline: int
    machine_busy_share: float  # of every CPU's time over the batches, busy with anyone's work

    @property
    def turns_per_s(self) -> float:
        return self.n_ok / self.window_s if self.window_s else math.nan

    @property
    def cpu_percent_per_worker(self) -> float:
        return 100 * self.cpu_us_sched * self.n_ok / 1e6 / self.window_s / self.workers if self.window_s else math.nan


def figures(batches: Iterable[Batch], workers: int = 1) -> Figures | None:
    chosen = list(batches)
    if not chosen:
        return None
    n_ok = sum(b.n_ok for b in chosen)
    sent = sum(b.n_ok + b.n_err for b in chosen) or 1
    turns = n_ok or 1
    cpu_ns = sum(b.cpu_ns for b in chosen)
    return Figures(
        n_ok=n_ok,
        n_err=sum(b.n_err for b in chosen),
        total=[x for b in chosen for x in b.total_ms],
        ttfb=[x for b in chosen for x in b.ttfb_ms],
        cpu_us_stat=sum(b.cpu_ticks for b in chosen) * 1e6 / CLOCK_TICKS / turns,
        cpu_us_sched=cpu_ns / 1e3 / turns,
        main_share=sum(b.main_thread_ns for b in chosen) / cpu_ns if cpu_ns else math.nan,
        backend_us=sum(b.backend_ns for b in chosen) / 1e3 / sent,
        window_s=sum(b.window_s for b in chosen),
        workers=workers,
        request_bytes=sum(b.request_bytes for b in chosen) / sent,
        body_bytes=sum(b.body_bytes for b in chosen) / sent,
        new_turn_bytes=sum(b.new_turn_bytes for b in chosen) / sent,
        rss_mib=chosen[-1].rss_kb / 1024,
        creates_inline=sum(b.creates_inline for b in chosen),
        machine_busy_share=(
            sum(b.machine_busy_ticks for b in chosen) / machine_ticks
            if (machine_ticks := sum(b.machine_ticks for b in chosen))
            else math.nan
        ),
    )


def _select(results: Results, phase: str, arm: str, size: str, mode: str, server: str | None = None) -> list[Batch]:
    return [
        b
        for b in results.batches
        if b.phase == phase
        and b.arm == arm
        and b.size == size
        and b.mode == mode
        and (server is None or b.server == server)
    ]


def _f(value: float, digits: int = 2) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def _n(value: float) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:,.0f}"


@dataclass(frozen=True, slots=True)
class Verdict:
    target: str
    measured: str
    status: str  # met | MISSED | reported | not measured


class Analysis:
    def __init__(self, plan: Plan, results: Results) -> None:
        self.plan = plan
        self.results = results
        self.sizes = list(plan.sizes)

    def latency(self, arm: str, size: str, mode: str) -> Figures | None:
        return figures(_select(self.results, "latency", arm, size, mode))

    def saturation(self, arm: str, size: str, mode: str) -> Figures | None:
        workers = len(self.plan.relay.pids) if arm == "R" and self.plan.relay else len(self.plan.s1.pids)
        return figures(_select(self.results, "saturation", arm, size, mode), workers)

    def added(self, arm: str, size: str, mode: str, q: float, *, ttfb: bool = False) -> float:
        x, a = self.latency(arm, size, mode), self.latency("A", size, mode)
        if x is None or a is None:
            return math.nan
        xs, as_ = (x.ttfb, a.ttfb) if ttfb else (x.total, a.total)
        return percentile(xs, q) - percentile(as_, q)

    def cpu(self, arm: str, size: str, mode: str, regime: str) -> float:
        """CPU us per turn: "c1" from the latency batches (one request at a time; sched, as 10 ms ticks are coarse
        for them), "sat" from the saturation windows (seconds long; stat, as the issue asks)."""
        if regime == "sat":
            sat = self.saturation(arm, size, mode)
            return sat.cpu_us_stat if sat is not None and sat.n_ok else math.nan
        lat = self.latency(arm, size, mode)
        return lat.cpu_us_sched if lat is not None and lat.n_ok else math.nan

    def cpu_regimes(self) -> list[tuple[str, str, list[str]]]:
        """(regime, its label, its modes) for every regime this run measured."""
        out: list[tuple[str, str, list[str]]] = []
        if self.plan.latency is not None:
            out.append(("c1", "1 at a time", list(self.plan.latency.modes)))
        if self.plan.saturation is not None:
            out.append(("sat", f"{self.plan.saturation.concurrency} in flight", list(self.plan.saturation.modes)))
        return out

    def cpu_check(self, x: str, y: str, size_x: str, size_y: str, limit: float) -> tuple[str, bool | None]:
        """Is CPU/turn of arm x at size_x <= limit x that of arm y at size_y, in every measured regime and mode?"""
        parts: list[str] = []
        checks: list[bool | None] = []
        for regime, name, modes in self.cpu_regimes():
            cells = []
            for mode in modes:
                a, b = self.cpu(x, size_x, mode, regime), self.cpu(y, size_y, mode, regime)
                ok = None if math.isnan(a) or math.isnan(b) or b == 0 else a <= limit * b
                checks.append(ok)
                cells.append(f"{mode} {_n(a)} vs {_n(b)} us = {_f(a / b if b else math.nan)}x")
            parts.append(f"{name}: " + ", ".join(cells))
        verdict = None if not checks or any(c is None for c in checks) else all(bool(c) for c in checks)
        return "; ".join(parts), verdict

    # -- the targets ---------------------------------------------------------------------------------------

    def verdicts(self) -> list[Verdict]:
        out: list[Verdict] = []
        small, mid, large = [*self.sizes, "", "", ""][:3]
        lat_modes = self.plan.latency.modes if self.plan.latency else []

        def status(ok: bool | None) -> str:
            return "not measured" if ok is None else ("met" if ok else "MISSED")

        def all_ok(checks: list[bool | None]) -> bool | None:
            return None if not checks or any(c is None for c in checks) else all(bool(c) for c in checks)

        text, ok = self.cpu_check("C", "R", small, small, 3.0)
        out.append(Verdict(f"CPU/turn C <= 3 x R at {small}", text, status(ok)))
        for size in (mid, large, *[label for label in self.sizes if label.endswith("-text")]):
            if size:
                text, ok = self.cpu_check("C", "B", size, size, 1.0)
                out.append(Verdict(f"CPU/turn C <= B at {size}", text, status(ok)))
        text, ok = self.cpu_check("C", "C", large, small, 2.0)
        out.append(Verdict(f"CPU/turn C at {large} <= 2 x C at {small}", text, status(ok)))

        for size, limit in ((small, 1.5), (large, 3.0)):
            checks, parts = [], []
            for mode in lat_modes:
                added = self.added("C", size, mode, 50)
                checks.append(None if math.isnan(added) else added <= limit)
                parts.append(f"{mode}: {_f(added)} ms (TTFB {_f(self.added('C', size, mode, 50, ttfb=True))} ms)")
            out.append(
                Verdict(
                    f"added latency C vs A, p50 <= {limit:g} ms at {size}", "; ".join(parts), status(all_ok(checks))
                )
            )
        checks, parts = [], []
        for size in self.sizes:
            for mode in lat_modes:
                p50, p99 = self.added("C", size, mode, 50), self.added("C", size, mode, 99)
                # A p50 at or below 0 leaves no room for any p99; judged on the absolute p99 then.
                checks.append(None if math.isnan(p99) else p99 <= 3 * max(p50, 0.0) or p99 <= 0.3)
                parts.append(f"{size} {mode}: p99 {_f(p99)} / p50 {_f(p50)} ms")
        out.append(Verdict("added latency C: p99 <= 3 x p50", "; ".join(parts), status(all_ok(checks))))
        checks, parts = [], []
        for size in self.sizes:
            for mode in lat_modes:
                d, c = self.added("D", size, mode, 50), self.added("C", size, mode, 50)
                checks.append(None if math.isnan(d) or math.isnan(c) else d <= 3 * max(c, 0.1))
                parts.append(f"{size} {mode}: D {_f(d)} vs C {_f(c)} ms")
        out.append(Verdict("added latency D <= 3 x C (p50)", "; ".join(parts), status(all_ok(checks))))

        checks, parts = [], []
        for size in self.sizes:
            sent = self.latency("C", size, "json")
            if sent is None:
                continue
            overhead = sent.body_bytes - sent.new_turn_bytes
            checks.append(overhead < 300)
            parts.append(
                f"{size}: body {_n(sent.body_bytes)} B = turn {_n(sent.new_turn_bytes)} B + {_n(overhead)} B "
                f"(HTTP request {_n(sent.request_bytes)} B)"
            )
        out.append(Verdict("client bytes/turn in C = new turn + < 300 B", "; ".join(parts), status(all_ok(checks))))

        tp = self.plan.throughput
        one = self.throughput(self.plan.s1.name)
        if tp is not None and one is not None:
            committed = [c for c in self.results.commit_checks if c.phase.startswith("throughput")]
            all_committed = all(c.turns_acknowledged == c.turns_in_database for c in committed)
            per_worker = one.turns_per_s / one.workers
            out.append(
                Verdict(
                    f"throughput C at {tp.size} ≥ 1,000 turns/s per worker (backend {tp.delay_ms} ms, "
                    f"{tp.concurrency} in flight), every turn committed",
                    f"{_n(per_worker)} turns/s (worker CPU {_n(one.cpu_percent_per_worker)}%); committed: "
                    + ", ".join(f"{c.turns_acknowledged} acked / {c.turns_in_database} in DB" for c in committed),
                    status(per_worker >= 1000 and all_committed and one.n_err == 0),
                )
            )
            two = self.throughput(self.plan.s2.name) if self.plan.s2 else None
            if two is not None:
                out.append(
                    Verdict(
                        f"scaling 1 → {two.workers} workers ≥ 1.8x",
                        f"{_n(one.turns_per_s)} → {_n(two.turns_per_s)} turns/s = "
                        f"{_f(two.turns_per_s / one.turns_per_s)}x (CPU per worker {_n(one.cpu_percent_per_worker)}% → "
                        f"{_n(two.cpu_percent_per_worker)}%; the machine's cores {_n(one.machine_busy_share * 100)}% → "
                        f"{_n(two.machine_busy_share * 100)}% busy with anyone's work)",
                        status(two.turns_per_s >= 1.8 * one.turns_per_s),
                    )
                )
        else:
            out.append(Verdict("throughput C ≥ 1,000 turns/s per worker; scaling", "", "not measured"))
        soak = self.results.soak
        if soak:
            steady = soak[len(soak) // 5 :] or soak
            first, last = steady[0].rss_kb / 1024, steady[-1].rss_kb / 1024
            peak = max(s.rss_kb for s in steady) / 1024
            growth = (last - first) / first if first else math.nan
            out.append(
                Verdict(
                    "RSS flat over a steady run (soak; growth after the first fifth <= 5 %)",
                    f"{_f(first, 1)} → {_f(last, 1)} MiB (peak {_f(peak, 1)}), {_f(growth * 100, 1)} % over "
                    f"{_n(steady[-1].t - steady[0].t)} s",
                    status(growth <= 0.05),
                )
            )
        else:
            rss = [b.rss_kb for b in self.results.batches if b.server == self.plan.s1.name and b.rss_kb]
            measured = f"this run: {_f(rss[0] / 1024, 1)} → {_f(rss[-1] / 1024, 1)} MiB" if rss else ""
            out.append(Verdict("RSS flat over a steady run", measured + " (judged by `--soak`)", "not measured"))
        whole = next((c for c in self.results.commit_checks if c.phase == "whole run"), None)
        if whole is not None:
            out.append(
                Verdict(
                    "every acknowledged threaded turn is in the database (whole run)",
                    f"{whole.turns_acknowledged} acknowledged, {whole.turns_in_database} in the database",
                    status(whole.turns_acknowledged == whole.turns_in_database),
                )
            )
        return out

    def throughput(self, server: str) -> Figures | None:
        tp = self.plan.throughput
        if tp is None:
            return None
        workers = len(self.plan.s2.pids) if self.plan.s2 and server == self.plan.s2.name else 1
        return figures(_select(self.results, "throughput", "C", tp.size, "json", server), workers)


# -- markdown ------------------------------------------------------------------------------------------------------


def _latency_table(an: Analysis) -> list[str]:
    plan = an.plan.latency
    if plan is None:
        return []
    lines = [
        "| size | mode | arm | n | p50 ms | p99 ms | added p50 ms | added p99 ms | TTFB added p50 ms "
        "| CPU us/turn (sched) | backend CPU us/req | request bytes/turn |",
        "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for size in an.sizes:
        for mode in plan.modes:
            for arm in plan.arms:
                f = an.latency(arm, size, mode)
                if f is None:
                    continue
                is_a = arm == "A"
                lines.append(
                    f"| {size} | {mode} | {arm} | {f.n_ok}{f' ({f.n_err} err)' if f.n_err else ''} "
                    f"| {_f(percentile(f.total, 50))} | {_f(percentile(f.total, 99))} "
                    f"| {'-' if is_a else _f(an.added(arm, size, mode, 50))} "
                    f"| {'-' if is_a else _f(an.added(arm, size, mode, 99))} "
                    f"| {'-' if is_a else _f(an.added(arm, size, mode, 50, ttfb=True))} "
                    f"| {'-' if is_a else _n(f.cpu_us_sched)} | {_n(f.backend_us)} | {_n(f.request_bytes)} |"
                )
    return lines


def _saturation_table(an: Analysis) -> list[str]:
    plan = an.plan.saturation
    if plan is None:
        return []
    lines = [
        "| size | mode | arm | turns/s per worker | worker CPU % | CPU us/turn (stat) | CPU us/turn (sched) "
        "| event-loop thread share | backend CPU us/req | RSS MiB | errors |",
        "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for size in plan.sizes:
        for mode in plan.modes:
            for arm in plan.arms:
                f = an.saturation(arm, size, mode)
                if f is None:
                    continue
                lines.append(
                    f"| {size} | {mode} | {arm} | {_n(f.turns_per_s / f.workers)} | {_n(f.cpu_percent_per_worker)} "
                    f"| {_n(f.cpu_us_stat)} | {_n(f.cpu_us_sched)} | {_f(f.main_share * 100, 0)} % "
                    f"| {_n(f.backend_us)} | {_f(f.rss_mib, 1)} | {f.n_err}"
                    f"{f' ({f.creates_inline} inline creates)' if f.creates_inline else ''} |"
                )
    return lines


def _sweep_table(an: Analysis) -> list[str]:
    plan = an.plan.saturation
    if plan is None or not plan.sweep:
        return []
    size = plan.sizes[0]
    levels = sorted({*plan.sweep, plan.concurrency})
    lines = [
        "| arm | " + " | ".join(f"{c} in flight" for c in levels) + " |",
        "|---|" + "--:|" * len(levels),
    ]
    for arm in ("R", "B", "C"):
        cells = []
        for level in levels:
            phase = "saturation" if level == plan.concurrency else "sweep"
            chosen = [b for b in _select(an.results, phase, arm, size, "json") if b.concurrency == level]
            f = figures(chosen)
            cells.append(f"{_n(f.cpu_us_sched)} us ({_n(f.turns_per_s)}/s)" if f is not None and f.n_ok else "-")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return lines


def _open_loop_table(an: Analysis) -> list[str]:
    plan = an.plan.open_loop
    if plan is None:
        return []
    lines = [
        "| size | rate /s | arm | n | p50 ms | p99 ms | added p50 ms | added p99 ms | CPU us/turn (sched) | errors |",
        "|---|--:|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for size, rate in plan.rates.items():
        base = figures(_select(an.results, "open", "A", size, "json"))
        for arm in plan.arms:
            f = figures(_select(an.results, "open", arm, size, "json"))
            if f is None:
                continue
            added50 = percentile(f.total, 50) - percentile(base.total, 50) if base and arm != "A" else math.nan
            added99 = percentile(f.total, 99) - percentile(base.total, 99) if base and arm != "A" else math.nan
            lines.append(
                f"| {size} | {rate:g} | {arm} | {f.n_ok} "
                f"| {_f(percentile(f.total, 50))} | {_f(percentile(f.total, 99))} "
                f"| {_f(added50)} | {_f(added99)} | {'-' if arm == 'A' else _n(f.cpu_us_sched)} | {f.n_err} |"
            )
    return lines


def _throughput_table(an: Analysis) -> list[str]:
    tp = an.plan.throughput
    if tp is None:
        return []
    lines = [
        "| server | turns/s | turns/s per worker | CPU % per worker | CPU us/turn (stat) | machine busy "
        "| p50 ms | p99 ms | errors |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for target in [an.plan.s1] + ([an.plan.s2] if an.plan.s2 else []):
        f = an.throughput(target.name)
        if f is None:
            continue
        lines.append(
            f"| {target.name} | {_n(f.turns_per_s)} | {_n(f.turns_per_s / f.workers)} | {_n(f.cpu_percent_per_worker)} "
            f"| {_n(f.cpu_us_stat)} | {_n(f.machine_busy_share * 100)} % | {_f(percentile(f.total, 50))} "
            f"| {_f(percentile(f.total, 99))} | {f.n_err} |"
        )
    return lines


def _soak_table(results: Results) -> list[str]:
    if not results.soak:
        return []
    lines = ["| t s | RSS MiB | turns | CPU ms | p50 ms | p99 ms | errors |", "|--:|--:|--:|--:|--:|--:|--:|"]
    step = max(1, len(results.soak) // 20)
    for s in results.soak[::step]:
        lines.append(
            f"| {s.t:.0f} | {s.rss_kb / 1024:.1f} | {s.turns} | {s.cpu_ticks * 1000 / CLOCK_TICKS:.0f} "
            f"| {_f(s.p50_ms)} | {_f(s.p99_ms)} | {s.errors} |"
        )
    return lines


def _profile_section(runs: list[ProfileRun]) -> list[str]:
    lines: list[str] = []
    for run in runs:
        s = run.summary
        lines += [
            f"**{s.name}**: {s.turns} continues, {s.wall_s / s.turns * 1000:.2f} ms wall per turn while sampled; "
            f"the event loop's thread used {s.cpu_us_per_turn:.0f} us CPU per turn; {s.samples} samples "
            f"({s.idle_share:.0%} idle in the loop). Shares are of the busy samples; us/turn = share x CPU/turn.",
            "",
            "By component (where the innermost Python frame was): "
            + ", ".join(f"{name} {share * 100:.0f} %" for name, share in s.by_component if share >= 0.01),
            "",
            "| self % | self us/turn | inclusive % | function (C calls it makes are charged to it) |",
            "|--:|--:|--:|---|",
        ]
        lines += [
            f"| {r.self_share * 100:.1f} | {r.self_us:.0f} "
            f"| {_f(r.inclusive_share * 100, 1) if r.inclusive_share else '-'} | `{r.function}` |"
            for r in s.by_self[:15]
        ]
        lines += [
            "",
            "<details><summary>inclusive: statestore's functions and the library calls they make</summary>",
            "",
            "| inclusive % | inclusive us/turn | function |",
            "|--:|--:|---|",
        ]
        lines += [
            f"| {r.inclusive_share * 100:.1f} | {r.inclusive_us:.0f} | `{r.function}` |" for r in s.by_inclusive[:30]
        ]
        lines += ["", "</details>", ""]
    return lines


def render(
    *,
    mode: str,
    command: str,
    machine: Machine,
    plan: Plan,
    results: Results,
    profiles: list[ProfileRun],
    elapsed_s: float,
    log_level: str,
    contention: Contention,
    summary: bool = False,
) -> str:
    """The run's report: every table (report.md); with `summary`, what bench/README.md keeps of it (the run, its
    targets, throughput and soak), the rest left to the run's own report.md."""
    an = Analysis(plan, results)
    lines = [
        f"### `{mode}` run — {machine.date}",
        "",
        f"- command: `{command}` (took {elapsed_s:.0f} s)",
        f"- machine: {machine.cores} cores, {machine.cpu_model}, Linux {machine.kernel}, Python {machine.python}; "
        f"commit {machine.commit}, code id {machine.code_at_start}"
        + (
            f" **(statestore's code changed during the run, to {machine.code_at_end}: the servers under load ran "
            "the code of the start; the profile server, started last, may have run the new code)**"
            if machine.code_at_end and machine.code_at_end != machine.code_at_start
            else ""
        ),
        *([f"- arm R's HTTP client: {machine.relay_client}"] if machine.relay_client else []),
        "- sizes (full request body of A/R/B; C/D threads start below and grow past it by a few turns): "
        + ", ".join(
            f"{t.size} = {t.full_body_bytes / 1024:.0f} KiB ({t.turns_per_thread} continues per thread, "
            f"{t.growth_per_turn} B each)"
            for t in results.threads
        ),
        f"- contention while measuring: load average {contention.load_average:.1f}; {contention.busy_cores:.2f} of "
        f"{machine.cores} cores busy on average, {contention.benchmark_cores:.2f} of them this benchmark's processes "
        f"(PostgreSQL, Redis and other people's work are the rest)",
        f"- statestore: `statestore serve` (uvicorn, uvloop, httptools), PostgreSQL + Redis, log level {log_level}, "
        f"default settings otherwise; {results.creates} threads made by creates",
        "",
        "#### Targets",
        "",
        "| target | measured | verdict |",
        "|---|---|---|",
    ]
    # Targets of phases this mode does not run are left out rather than listed as unmeasured.
    verdicts = [v for v in an.verdicts() if v.measured or v.status != "not measured"]
    lines += [f"| {v.target} | {v.measured} | **{v.status}** |" for v in verdicts]
    if not summary and plan.saturation is not None:
        lines += [
            "",
            f"#### Saturation: closed loop, {plan.saturation.concurrency} clients, backend delay "
            f"{plan.saturation.delay_ms} ms, {plan.saturation.rounds} x {plan.saturation.seconds:g} s per arm",
            "",
            *_saturation_table(an),
        ]
        if plan.saturation.sweep:
            lines += [
                "",
                f"CPU per turn (and turns/s) against turns in flight, {plan.saturation.sizes[0]} JSON, backend "
                f"{plan.saturation.delay_ms} ms (with an httpx upstream pool the cost per turn grew with the "
                "connections in flight; see the findings)",
                "",
                *_sweep_table(an),
            ]
    if not summary and plan.latency is not None:
        lines += [
            "",
            f"#### Latency: closed loop at concurrency 1, no backend delay, {plan.latency.rounds} rounds x "
            f"{plan.latency.batch} requests per arm, arms interleaved",
            "",
            *_latency_table(an),
        ]
    if not summary and plan.open_loop is not None:
        lines += [
            "",
            f"#### Open loop: fixed arrival rate, backend delay {plan.open_loop.delay_ms} ms, "
            f"{plan.open_loop.rounds} x "
            f"{plan.open_loop.seconds:g} s per arm (latency from the scheduled send time)",
            "",
            *_open_loop_table(an),
        ]
    if plan.throughput is not None:
        tp = plan.throughput
        lines += [
            "",
            f"#### Throughput and scaling: arm C at {tp.size}, {tp.concurrency} clients, "
            f"backend delay {tp.delay_ms} ms, "
            f"{tp.rounds} x {tp.seconds:g} s per server, interleaved",
            "",
            *_throughput_table(an),
        ]
    if results.soak and plan.soak is not None:
        lines += [
            "",
            f"#### Soak: arm C at {plan.soak.size}, open loop at {plan.soak.rate:g} turns/s, backend delay "
            f"{plan.soak.delay_ms} ms; every 10 s (a fifth of the requests start a conversation with a create, "
            "which their latency and the CPU include)",
            "",
            *_soak_table(results),
        ]
    if summary:
        lines += ["", "Every table of the run (saturation, latency, open loop, profiles) is in its own report.md."]
    elif profiles:
        lines += ["", "#### Profiles (stack samples inside a statestore server, `bench/profiling.py`)", ""]
        lines += _profile_section(profiles)
    return "\n".join(lines) + "\n"


def write_report(
    *,
    mode: str,
    command: str,
    machine: Machine,
    plan: Plan,
    results: Results,
    profiles: list[ProfileRun],
    elapsed_s: float,
    readme: Path | None,
    log_level: str,
    contention: Contention,
) -> str:
    text = render(
        mode=mode,
        command=command,
        machine=machine,
        plan=plan,
        results=results,
        profiles=profiles,
        elapsed_s=elapsed_s,
        log_level=log_level,
        contention=contention,
    )
    if readme is not None:
        kept = render(
            mode=mode,
            command=command,
            machine=machine,
            plan=plan,
            results=results,
            profiles=profiles,
            elapsed_s=elapsed_s,
            log_level=log_level,
            contention=contention,
            summary=True,
        )
        start, end = f"<!-- bench:{mode}:start -->", f"<!-- bench:{mode}:end -->"
        block = f"{start}\n{kept}{end}"
        current = readme.read_text() if readme.exists() else ""
        if start in current and end in current:
            current = re.sub(re.escape(start) + ".*?" + re.escape(end), lambda _: block, current, flags=re.S)
        else:
            current = current.rstrip("\n") + "\n\n" + block + "\n"
        readme.write_text(current)
    return text


ARM_LEGEND = "\n".join(f"- **{arm}**: {name}" for arm, name in ARM_NAMES.items())
