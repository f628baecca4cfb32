"""A profile of statestore's continue, taken inside a real server process without touching statestore's code.

`python -m bench.profiling serve --port N` runs statestore's app (the same `create_server_app`, settings from the same
STATESTORE_* environment, uvicorn with uvloop and the HTTP and WebSocket protocols `statestore serve` runs) wrapped
in a small ASGI layer that adds two routes: `POST /__bench/profile/start` starts a stack sampler on the event loop's
thread (bench/sampler.py: samples follow that thread's CPU time, and it copes with SQLAlchemy's greenlets, which
cProfile does not) and `POST /__bench/profile/stop?out=<path>` stops it and writes the samples as JSON. The client
drives continues between the two (see `profile_continues`), so the profile holds nothing but the turns, and no client
code.

Time in uvloop's own C code (socket reads and writes it does by itself, the poll) and in other threads (anyio's
worker threads) is not in the samples; C calls made from Python are charged to their Python caller.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from bench import conversation as conv
from bench.rawhttp import HttpConnection, render_request
from bench.sampler import Stack, StackSampler, is_idle, is_own

_CONTROL = "/__bench/profile/"


class ProfileSwitch:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.sampler: StackSampler | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(_CONTROL):
            await self.app(scope, receive, send)
            return
        action = scope["path"][len(_CONTROL) :]
        if action == "start":
            self.sampler = StackSampler()
            self.sampler.start()
        elif action == "stop" and self.sampler is not None:
            self.sampler.stop()
            out = parse_qs(scope["query_string"].decode())["out"][0]
            dump = {"cpu_ns": self.sampler.cpu_ns, "samples": [[list(s), n] for s, n in self.sampler.samples.items()]}
            Path(out).write_bytes(orjson.dumps(dump))
            self.sampler = None
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})


def serve(port: int) -> None:
    import uvicorn

    from statestore.app import create_server_app
    from statestore.cli import uvicorn_options
    from statestore.config import Settings
    from statestore.logs import configure_logging

    settings = Settings()
    configure_logging(settings.log_level, settings.log_json)
    # Served as `statestore serve` serves, so that a WebSocket's profile holds statestore's own writes.
    uvicorn.run(
        ProfileSwitch(create_server_app(settings)),
        host="127.0.0.1",
        port=port,
        lifespan="on",
        **uvicorn_options(settings),
    )


# -- the client side ------------------------------------------------------------------------------------------------


_HEADERS = [
    ("content-type", "application/json"),
    ("x-api-key", "bench-key"),
    ("anthropic-version", "2023-06-01"),
    ("anthropic-beta", conv.THREADS_BETA),
]


async def _post(conn: HttpConnection, port: int, path: str, body: bytes) -> tuple[int, str | None, str | None]:
    reply = await conn.request(render_request("127.0.0.1", port, path, _HEADERS, body))
    return reply.status, reply.message_id(), reply.thread_id


async def profile_continues(
    port: int, *, size_bytes: int, stream: bool, turns: int, warmup: int, out: Path, arm: str = "C"
) -> float:
    """Continue threads of `size_bytes` `warmup` times, then `turns` times under the profiler. Returns the wall
    time of the profiled turns. Every thread is made (by a create) before the profile starts and continued at most
    its growth budget of times, so the profile holds continues only. With `arm="B"` the turns are stateless relays
    of the full history instead (no thread at all)."""
    conversation = conv.build_conversation(size_bytes)
    full = conv.FullBody(conversation, stream=stream)
    conn = await HttpConnection.open("127.0.0.1", port)
    n = 0

    async def make_threads(count: int) -> list[list[str]]:
        made = []
        for _ in range(count):
            status, message_id, _ = await _post(conn, port, "/v1/messages", conv.create_body(conversation))
            if status != 200 or message_id is None:
                raise RuntimeError(f"create failed: {status}")
            made.append([message_id])
        return made

    async def run(count: int) -> float:
        nonlocal n
        per_thread = conversation.turns_per_thread
        threads = await make_threads(-(-count // per_thread)) if arm == "C" else []
        if profiling:
            await _post(conn, port, _CONTROL + "start", b"")
        started = time.perf_counter()
        for k in range(count):
            n += 1
            if arm == "B":
                body, _ = full.render(10_000_000 + n)
                status, _, _ = await _post(conn, port, "/v1/messages", body)
                if status != 200:
                    raise RuntimeError(f"relay failed: {status}")
                continue
            head = threads[k // per_thread]
            body, _ = conv.continue_body(head[0], 10_000_000 + n, stream=stream)
            status, message_id, _ = await _post(conn, port, "/v1/messages", body)
            if status != 200 or message_id is None:
                raise RuntimeError(f"continue failed: {status}")
            head[0] = message_id
        return time.perf_counter() - started

    try:
        profiling = False
        await run(warmup)
        profiling = True
        elapsed = await run(turns)
        await _post(conn, port, f"{_CONTROL}stop?out={out}", b"")
    finally:
        conn.close()
    return elapsed


# -- reading a profile --------------------------------------------------------------------------------------------

# The first needle a file's path holds names its component. statestore's own Redis client (store/resp.py,
# resp_reader.py, resp_cluster.py) is a component apart, as a library would be, ahead of the rest of statestore.
_COMPONENTS = (
    ("/statestore/store/resp.py", "Redis client"),
    ("/statestore/store/resp_", "Redis client"),
    ("/statestore/", "statestore"),
    ("/sqlalchemy/", "SQLAlchemy"),
    ("/asyncpg/", "asyncpg"),
    ("/httpx/", "httpx"),
    ("/httpcore/", "httpcore"),
    ("/h11/", "h11"),
    ("/anyio/", "anyio"),
    ("/starlette/", "Starlette"),
    ("/fastapi/", "FastAPI"),
    ("/uvicorn/", "uvicorn"),
    ("/prometheus_client/", "prometheus_client"),
    ("/pydantic", "pydantic"),
    ("/greenlet/", "greenlet"),
    ("/logging/", "logging (stdlib)"),
    ("/asyncio/", "asyncio (stdlib)"),
    ("/bench/", "bench sampler switch"),
)


def component(filename: str) -> str:
    for needle, name in _COMPONENTS:
        if needle in filename:
            return name
    return "other stdlib" if "/python3" in filename else "other"


def label(frame: tuple[str, int, str]) -> str:
    path, line, function = frame
    for marker in ("site-packages/", "/work/main/", "/lib/python3.11/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{path}:{line}({function})"


@dataclass(slots=True)
class ProfileRow:
    function: str
    component: str
    self_share: float  # of the loop thread's busy samples
    inclusive_share: float
    self_us: float  # per turn: the share times the loop thread's CPU per turn
    inclusive_us: float


@dataclass(slots=True)
class ProfileSummary:
    name: str
    turns: int
    wall_s: float
    cpu_us_per_turn: float  # of the event loop's thread while profiling
    samples: int
    idle_share: float
    by_self: list[ProfileRow] = field(default_factory=list)
    by_inclusive: list[ProfileRow] = field(default_factory=list)
    by_component: list[tuple[str, float]] = field(default_factory=list)  # component, share of busy samples


def summarize(name: str, path: Path, turns: int, wall_s: float, *, top: int = 18) -> ProfileSummary:
    dump = orjson.loads(path.read_bytes())
    samples: list[tuple[Stack, int]] = [
        (tuple((str(f[0]), int(f[1]), str(f[2])) for f in stack), int(n)) for stack, n in dump["samples"]
    ]
    total = sum(n for _, n in samples)
    busy = [(stack, n) for stack, n in samples if not is_idle(stack) and not is_own(stack)]
    busy_total = sum(n for _, n in busy) or 1
    cpu_us = dump["cpu_ns"] / 1e3 / turns
    own: dict[tuple[str, int, str], int] = {}
    inclusive: dict[tuple[str, int, str], int] = {}
    parts: dict[str, int] = {}
    for stack, n in busy:
        own[stack[0]] = own.get(stack[0], 0) + n
        parts[component(stack[0][0])] = parts.get(component(stack[0][0]), 0) + n
        # Inclusive time of statestore's functions, and of the first library function each one calls.
        kept = {
            frame
            for i, frame in enumerate(stack)
            if component(frame[0]) == "statestore"
            or (i + 1 < len(stack) and component(stack[i + 1][0]) == "statestore")
        }
        for frame in kept:
            inclusive[frame] = inclusive.get(frame, 0) + n

    def row(frame: tuple[str, int, str]) -> ProfileRow:
        self_share, incl_share = own.get(frame, 0) / busy_total, inclusive.get(frame, 0) / busy_total
        return ProfileRow(
            label(frame), component(frame[0]), self_share, incl_share, self_share * cpu_us, incl_share * cpu_us
        )

    summary = ProfileSummary(name, turns, wall_s, cpu_us, total, 1 - busy_total / total if total else 0.0)
    summary.by_self = [row(f) for f in sorted(own, key=lambda f: own[f], reverse=True)[:top]]
    summary.by_inclusive = [row(f) for f in sorted(inclusive, key=lambda f: inclusive[f], reverse=True)][: top + 12]
    summary.by_component = sorted(((k, v / busy_total) for k, v in parts.items()), key=lambda kv: kv[1], reverse=True)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.profiling")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_cmd = commands.add_parser("serve", help="statestore's app under a cProfile switch")
    serve_cmd.add_argument("--port", type=int, required=True)
    show = commands.add_parser("show", help="summarise a samples file")
    show.add_argument("path", type=Path)
    show.add_argument("--turns", type=int, default=1)
    args = parser.parse_args()
    if args.command == "serve":
        serve(args.port)
        return
    summary = summarize(args.path.name, args.path, args.turns, 0.0)
    print(f"{summary.samples} samples, idle {summary.idle_share:.0%}, {summary.cpu_us_per_turn:.0f} us/turn")
    for row in summary.by_self:
        print(f"{row.self_share:6.1%} {row.inclusive_share:6.1%}  {row.function}")
    for row in summary.by_inclusive:
        print(f"       {row.inclusive_share:6.1%}  {row.function}")
    for name, share in summary.by_component:
        print(f"{share * 100:5.1f}%  {name}")


if __name__ == "__main__":
    main()
