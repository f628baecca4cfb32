"""`python -m bench.bytecodes --base REV`: the Python bytecodes a continue runs, function by function, in the working
tree's statestore and in another revision's.

CPU readings on these shared two-core machines stray by 5 % and more from one run to the next, so a change of a few
per cent needs many runs to show (bench.ab --repeat). What the interpreter executes does not stray: each server runs
under a tracer that counts the bytecodes of every Python function (sys.settrace with opcode events) over `--turns`
continues, after a warm-up, and the counts per turn are set side by side. It is a count, not a time: a bytecode that
calls into C (orjson, asyncpg, hiredis) counts once whatever the call costs, and time in C and in the kernel is not
seen at all. It says where Python work was added or removed; bench.ab says what that was worth.

    .venv/bin/python -m bench.bytecodes --base 26661a8 [--door messages|responses|socket]
        [--turns 200] [--history-kb 8] [--top 40]

The traced server is `statestore serve` started through this file's `serve` command: SIGUSR1 starts the count on the
event loop's thread, SIGUSR2 stops it and writes the counts to $STATESTORE_BENCH_BYTECODES_OUT. Tracing makes each
turn some twenty times slower; only the counts mean anything.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

_OUT = "STATESTORE_BENCH_BYTECODES_OUT"


def serve(port: int) -> None:
    """statestore's server with a bytecode counter switched by signals (this runs under the revision's own code)."""
    counts: collections.Counter[CodeType] = collections.Counter()
    entries: collections.Counter[CodeType] = collections.Counter()

    def local(frame: FrameType, event: str, _arg: Any) -> Callable[..., Any]:
        if event == "opcode":
            counts[frame.f_code] += 1
        return local

    def first(frame: FrameType, _event: str, _arg: Any) -> Callable[..., Any]:
        frame.f_trace_opcodes = True
        entries[frame.f_code] += 1  # a call, or a coroutine's resumption
        return local

    def start(*_: object) -> None:
        counts.clear()
        entries.clear()
        sys.settrace(first)

    def stop(*_: object) -> None:
        sys.settrace(None)
        out = Path(os.environ[_OUT])
        lines = [f"{n}\t{entries[code]}\t{code.co_filename}:{code.co_qualname}\n" for code, n in counts.most_common()]
        out.with_suffix(".tmp").write_text("".join(lines))
        out.with_suffix(".tmp").rename(out)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    from statestore.cli import main

    sys.argv = ["statestore", "serve", "--port", str(port)]
    main()


_PLACE = re.compile(r"^.*?(site-packages/|/lib/python3\.\d+/)")


def _name(location: str, code_root: str) -> str:
    """`statestore/<module>.py:f` for the revision's own code, `<package>/<module>.py:f` for a library's, whichever tree
    it ran from."""
    if _PLACE.match(location):  # a library's or the standard library's (the venv may lie inside the checkout)
        return _PLACE.sub("", location)
    return location.removeprefix(code_root)


def _read(path: Path, code_root: str, turns: int) -> tuple[dict[str, float], dict[str, float]]:
    counts: dict[str, float] = collections.defaultdict(float)
    entries: dict[str, float] = collections.defaultdict(float)
    for line in path.read_text().splitlines():
        n, entered, location = line.split("\t", 2)
        name = _name(location, code_root)
        counts[name] += int(n) / turns
        entries[name] += int(entered) / turns
    return counts, entries


def _count(code: Path, args: argparse.Namespace, work: Path, stack: ExitStack, echo_url: str) -> Path:
    """Run one side's server under the counter; the counts' file."""
    # Imported here, not at the top: `serve` runs this file under another revision's code, whose bench/ differs.
    from bench.counted import continue_counted, serve_side
    from bench.procs import python

    out = work / f"{code.name}.bytecodes"
    server, url = serve_side(
        code,
        lambda port: [python(), str(Path(__file__).resolve()), "serve", "--port", str(port)],
        work=work,
        stack=stack,
        echo_url=echo_url,
        env={_OUT: str(out)},
    )

    def start() -> None:
        os.kill(server.pid, signal.SIGUSR1)
        time.sleep(0.2)

    continue_counted(url, args, warm=150, start=start, stop=lambda: os.kill(server.pid, signal.SIGUSR2))
    deadline = time.monotonic() + 30
    while not out.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no counts from {code}:\n{server.log_tail()}")
        time.sleep(0.1)
    return out


def _report(
    base: tuple[dict[str, float], dict[str, float]],
    head: tuple[dict[str, float], dict[str, float]],
    top: int,
    label: str,
) -> None:
    (b, b_in), (h, h_in) = base, head
    print(
        f"bytecodes per continue: base {sum(b.values()):,.0f}, head {sum(h.values()):,.0f} "
        f"({sum(h.values()) / sum(b.values()):.3f}x); functions entered: base {sum(b_in.values()):,.0f}, "
        f"head {sum(h_in.values()):,.0f}"
    )

    def package(name: str) -> str:
        return name.split("/", 1)[0] if "/" in name else name.split(":", 1)[0]

    by_package: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for side, counts in enumerate((b, h)):
        for name, n in counts.items():
            by_package[package(name)][side] += n
    print("\nby package          base     head")
    for name, (nb, nh) in sorted(by_package.items(), key=lambda kv: -sum(kv[1]))[:10]:
        print(f"  {name:16} {nb:7,.0f}  {nh:7,.0f}  {nh - nb:+7,.0f}")
    rows = sorted(((h.get(k, 0.0) - b.get(k, 0.0), k) for k in set(b) | set(h)), reverse=True)
    for title, chosen in (("added", rows[:top]), ("removed", sorted(rows)[: top // 2])):
        print(f"\n{title} ({label}): head - base, base, head, functions entered base/head")
        for diff, name in chosen:
            if diff == 0:
                break
            entered = f"{b_in.get(name, 0):4.1f}/{h_in.get(name, 0):4.1f}"
            print(f"  {diff:+6.0f} {b.get(name, 0):6.0f} {h.get(name, 0):6.0f}  {entered}  {name}")


def main(argv: list[str] | None = None) -> None:
    if argv is None and sys.argv[1:2] == ["serve"]:
        serve(int(sys.argv[sys.argv.index("--port") + 1]))
        return
    from bench.counted import arguments, both_sides

    top_help = "functions listed (default 40)"
    args = arguments("python -m bench.bytecodes", __doc__, argv, turns=200, top=40, top_help=top_help)
    base, head = both_sides(
        args.base,
        lambda code, work, stack, echo_url: _read(_count(code, args, work, stack, echo_url), f"{code}/", args.turns),
    )
    door = {"messages": "threaded", "responses": "Responses", "socket": "WebSocket Responses"}[args.door]
    print(
        f"{args.turns} {door} continues per side, history {args.history_kb} KiB; "
        f"base {args.base}, head the working tree"
    )
    _report(base, head, args.top, f"bytecodes per continue, {door}")


if __name__ == "__main__":
    main()
