"""`python -m bench.instructions --base REV`: the machine instructions a continue costs the server, in the working
tree's statestore and in another revision's, counted by valgrind (callgrind).

A CPU time on these shared two-core machines strays by 5 % and more from one run to the next (bench.ab needs nine
runs to place a 5 % change); an instruction count barely does: the same code, inputs and settings count the same
within about 0.5 % (how the event loop batches its wake-ups varies), whatever else the machine is doing. Each server
runs under callgrind with collection off; after a warm-up it is switched on (`callgrind_control -i on`) for `--turns`
continues and off again, so the count holds the turns and nothing else: every instruction the server's process ran in
user space for them, in the interpreter, in C extensions (pydantic-core, orjson, asyncpg, uvloop, hiredis) and in
libc. Not counted: the kernel (system calls), and what PostgreSQL, Redis and the backend do. It says what a change
costs in the server's own work; bench.ab says what that is worth in time, kernel included.

    .venv/bin/python -m bench.instructions --base 26661a8 [--door messages|responses|socket]
        [--turns 100] [--history-kb 8] [--top 30] [--cache]
    .venv/bin/python -m bench.instructions --floor [--turns 100] [--history-kb 8] [--top 30] [--cache]

`--floor` sets the working tree's threaded continue beside the floor of one (bench/floor.py, arm F of
bench.floor_compare: the least a Python server on this stack must do to continue a thread durably), counted the same
way: the C/F of bench.floor_compare in instructions, and where statestore's own work goes.

An instruction is not a cycle: code that misses the caches or mispredicts more branches runs the same count slower.
`--cache` has callgrind simulate the caches and the branch predictors as well (about twice as slow) and prints the
misses of each side per continue and KCachegrind's estimate of cycles (an instruction 1, a first-level miss or a
mispredicted branch 10, a last-level miss 100), which tracks bench.ab's CPU ratios more closely than the count alone;
`--top` then lists the C functions by their own estimated cycles.

A turn under callgrind takes some fifty times longer, so work a server does by the clock rather than by the turn (the
background runner's poll) would be counted fifty times over: both servers poll once a minute here
(STATESTORE_BACKGROUND_POLL_SECONDS=60). `--top` lists the C functions whose own instructions changed most, as
`callgrind_annotate` names them (the interpreter's functions stand for Python code).
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import time
from contextlib import ExitStack
from pathlib import Path

from bench.procs import Service

# Work done by the clock, not by the turn, is not to be counted fifty times over (see above).
_SETTINGS = {"STATESTORE_BACKGROUND_POLL_SECONDS": "60"}
_SIMULATED = {
    "I1mr": "instruction fetches missing the first-level cache",
    "D1mr": "data reads missing it",
    "D1mw": "data writes missing it",
    "ILmr": "instruction fetches missing the last level",
    "DLmr": "data reads missing the last level",
    "DLmw": "data writes missing the last level",
    "Bcm": "conditional branches mispredicted",
    "Bim": "indirect branches mispredicted",
}
_COLUMN = re.compile(r"[\d,]+ \(\s*[\d.]+%\)|[\d,]+|\.")
# Where the function's name starts: after the last column and its spaces.
_NAME_AT = re.compile(r"^(?:\s*(?:[\d,]+ \(\s*[\d.]+%\)|[\d,]+|\.))+\s+")


def _callgrind(out: Path, args: argparse.Namespace) -> list[str]:
    simulated = ["--cache-sim=yes", "--branch-sim=yes"] if args.cache else []
    return ["valgrind", "--tool=callgrind", "--instr-atstart=no", *simulated, f"--callgrind-out-file={out}"]


def _count(code: Path, args: argparse.Namespace, work: Path, stack: ExitStack, echo_url: str) -> Path:
    """Run one side's statestore under callgrind; the file of its counted turns."""
    from bench.counted import serve_side
    from bench.procs import python

    out = work / f"{code.name}.callgrind"
    server, url = serve_side(
        code,
        lambda port: [*_callgrind(out, args), python(), "-m", "statestore.cli", "serve", "--port", str(port)],
        work=work,
        stack=stack,
        echo_url=echo_url,
        env=_SETTINGS,
        health_timeout=600,  # the imports alone take a minute under valgrind
    )
    return _counted(server, url, args, out)


def _count_floor(args: argparse.Namespace, work: Path, stack: ExitStack, echo_url: str) -> Path:
    """Run the floor of a threaded turn (bench/floor.py) under callgrind; the file of its counted turns."""
    from bench.counted import serve_floor

    out = work / "floor.callgrind"
    server, url = serve_floor(_callgrind(out, args), work=work, stack=stack, echo_url=echo_url, health_timeout=600)
    return _counted(server, url, args, out)


def _counted(server: Service, url: str, args: argparse.Namespace, out: Path) -> Path:
    """Warm `server` up, count its continues, and wait for callgrind's dump of them."""
    from bench.counted import continue_counted

    def control(*flags: str) -> None:
        subprocess.run(["callgrind_control", *flags, str(server.pid)], check=True, capture_output=True)

    def stop() -> None:
        control("-i", "off")
        control("-d")  # dumped as `<out>.1`

    continue_counted(url, args, warm=60, start=lambda: control("-i", "on"), stop=stop)
    dump = out.with_name(out.name + ".1")
    deadline = time.monotonic() + 60
    while not dump.exists() or "totals:" not in dump.read_text(errors="replace"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no callgrind dump from {server.name}:\n{server.log_tail()}")
        time.sleep(0.2)
    return dump


def _events(dump: Path) -> dict[str, int]:
    """The dump's totals by event (Ir; with --cache also cache misses and branches, callgrind's names)."""
    lines = dump.read_text(errors="replace").splitlines()
    names = next(line for line in lines if line.startswith("events:")).split()[1:]
    totals = next(line for line in lines if line.startswith("totals:")).split()[1:]
    return dict(zip(names, map(int, totals), strict=True))


def _estimate(events: dict[str, int]) -> int:
    """Cycles as KCachegrind estimates them: an instruction 1, a first-level miss or a mispredicted branch 10, a
    last-level miss 100."""
    first = events["I1mr"] + events["D1mr"] + events["D1mw"]
    last = events["ILmr"] + events["DLmr"] + events["DLmw"]
    return events["Ir"] + 10 * (first + events["Bcm"] + events["Bim"]) + 100 * last


def _functions(dump: Path, *, cache: bool) -> tuple[dict[str, int], collections.Counter[str]]:
    """(the totals by event, each function's own instructions, or with `cache` its own estimated cycles), from the
    dump and callgrind_annotate."""
    shown = ["Ir", *_SIMULATED] if cache else ["Ir"]
    annotated = subprocess.run(
        [
            "callgrind_annotate",
            "--threshold=100",
            "--inclusive=no",
            f"--show={','.join(shown)}",
            "--sort=Ir",
            str(dump),
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    functions: collections.Counter[str] = collections.Counter()
    for line in annotated.splitlines():
        # A row: a column an event (`1,234 (0.5%)`, or `0` or `.` for none), then the function.
        at = _NAME_AT.match(line)
        if at is None:
            continue
        columns, name = _COLUMN.findall(line, 0, at.end()), line[at.end() :]
        if len(columns) != len(shown) or "PROGRAM TOTALS" in name:
            continue
        values = (0 if column == "." else int(column.split()[0].replace(",", "")) for column in columns)
        counts = dict(zip(shown, values, strict=True))
        # `dir/Python-3.11.7/Objects/dictobject.c:insertdict [lib]` -> `Objects/dictobject.c:insertdict`; a function's
        # recursion depths (`'2`) are one function.
        name = re.sub(r"^.*?/Python-\d+\.\d+\.\d+/", "", re.sub(r" \[.*\]$", "", name))
        functions[re.sub(r"'\d+$", "", name)] += _estimate(counts) if cache else counts["Ir"]
    return _events(dump), functions


def main(argv: list[str] | None = None) -> None:
    from bench.counted import arguments, both_sides

    top_help = "C functions listed (default 20; 0: none)"
    prog = "python -m bench.instructions"
    args = arguments(prog, __doc__, argv, turns=100, top=20, top_help=top_help, callgrind=True)
    if args.floor and args.door != "messages":
        raise SystemExit("--floor: the floor continues threads only (--door messages)")
    (base_events, base), (head_events, head) = both_sides(
        args.base,
        lambda code, work, stack, echo_url: _functions(_count(code, args, work, stack, echo_url), cache=args.cache),
        floor=(lambda work, stack, echo_url: _functions(_count_floor(args, work, stack, echo_url), cache=args.cache))
        if args.floor
        else None,
    )
    door = {"messages": "threaded", "responses": "Responses", "socket": "WebSocket Responses"}[args.door]
    first, second = ("floor", "statestore") if args.floor else ("base", "head")
    against = "the floor (bench/floor.py)" if args.floor else f"base {args.base}"
    per = args.turns
    base_total, head_total = base_events["Ir"], head_events["Ir"]
    print(
        f"{args.turns} {door} continues per side, history {args.history_kb} KiB; {against}, {second} the working "
        f"tree\ninstructions per continue: {first} {base_total / per:,.0f}, {second} {head_total / per:,.0f} "
        f"({head_total / base_total:.3f}x)"
    )
    if args.cache:
        print(f"\nsimulated, per continue: {first}, {second}")
        for event, meaning in _SIMULATED.items():
            print(f"  {base_events[event] / per:11,.0f} {head_events[event] / per:11,.0f}  {event}: {meaning}")
        estimates = _estimate(base_events), _estimate(head_events)
        print(
            f"estimated cycles per continue: {first} {estimates[0] / per:,.0f}, {second} {estimates[1] / per:,.0f} "
            f"({estimates[1] / estimates[0]:.3f}x)"
        )
    if args.top:
        rows = sorted(((head[k] - base[k], k) for k in set(base) | set(head)), key=lambda row: -abs(row[0]))
        own = "estimated cycles" if args.cache else "instructions"
        print(f"\nC functions, own {own} per continue: {second} - {first}, {first}, {second}")
        for diff, name in rows[: args.top]:
            print(f"  {diff / per:+9,.0f} {base[name] / per:9,.0f} {head[name] / per:9,.0f}  {name[:110]}")


if __name__ == "__main__":
    main()
