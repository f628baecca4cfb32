"""The Responses continue beside the threaded continue, at ≈ 2k and ≈ 200k tokens of history, side by side in one
run (closed loop, concurrency 1, no backend delay), so the figures compare as ratios on whatever machine runs it.

    make bench-responses                                   # 100 rounds per size
    .venv/bin/python -m bench.responses_arm --rounds 20    # quicker
    .venv/bin/python -m bench.responses_arm --arms response,response-sse,socket   # WebSocket mode beside HTTP

Each arm runs a batch of turns at a time, interleaved each round, and each batch is billed (bench/bill.py):
statestore's CPU, PostgreSQL's and Redis's per turn, and their total, beside the latency.

Arms, interleaved each round:
  chat      the client sends the whole history to the echo backend's /v1/chat/completions (the baseline)
  thread    statestore `thread: continue` on /v1/messages, only the new turn (history hot in the cache)
  response  statestore `POST /v1/responses` with previous_response_id = the chain's head, only the new turn
            (the head's context is read from the cache in one value)
  branch    as `response`, but from the head's parent: a branch, rebuilt from the database
  conversation  statestore `POST /v1/responses` on a conversation holding the history, only the new turn (the
            conversation's context is read from the cache, checked against the position its lease returns)
  head@D, branch@D, first-branch@D  (with --depths D,…) on a chain D responses deep made of small turns: a
            continue from its head (stored, so the head moves on), a branch from a response no turn branched from
            before (first-branch: its context read from the database; the deepest one not yet branched from, one
            shallower each turn), and a regenerate from the response below the head (branch: stored, a new sibling
            each time; its context read from the database the first time, then from the branch point it keeps)
The history is the same text for every arm: alternating user and assistant messages with escapes and non-ASCII.
Runs on a PostgreSQL cluster and a redis-server of its own (bench/throwaway.py), so that nothing else on the machine
lands on the bill; with --services shared, on the ones `make bench` uses (STATESTORE_BENCH_PG /
STATESTORE_BENCH_REDIS). The scratch database and the Redis prefix are removed at the end. Prints a table and writes
JSON to $TMPDIR.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.bill import Bill, Meter, add
from bench.harness import DEFAULT_PG, DEFAULT_REDIS, _statestore_env, redis_prefix, scratch_database
from bench.procs import Service, free_port, python
from bench.throwaway import postgres_cluster, redis_server

SIZES = {"2k": 8 * 1024, "200k": 800 * 1024}
BETA = "message-threads-2026-08-12"
KEY = "bench-key"


def history(target_bytes: int) -> list[tuple[str, str]]:
    """(role, text) pairs, user first, about `target_bytes` of JSON."""
    turns: list[tuple[str, str]] = []
    size = 0
    n = 0
    while size < target_bytes:
        text = f'Turn {n}: a "quoted" line, a tab\\t, café ☕ and some filler words to make it realistic. ' * 4
        turns.append(("user" if n % 2 == 0 else "assistant", text))
        size += len(text) + 40
        n += 1
    if turns[-1][0] == "user":
        turns.append(("assistant", "ok"))
    return turns


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Arms:
    def __init__(self, http: aiohttp.ClientSession, statestore: str, backend: str, turns: list[tuple[str, str]]):
        self.http = http
        self.statestore = statestore
        self.backend = backend
        self.turns = turns
        self.thread_head = ""
        self.response_head = ""
        self.response_parent = ""
        self.conversation_id = ""
        self.sse_head = ""
        self.socket_head = ""
        self.socket: aiohttp.ClientWebSocketResponse | None = None
        self.offer_deflate = False  # the socket's client offers permessage-deflate, as the SDKs' do
        self.n = 0

    async def _post(self, url: str, body: Any, headers: dict[str, str]) -> tuple[float, Any, dict[str, str]]:
        started = time.perf_counter()
        async with self.http.post(url, data=orjson.dumps(body), headers=headers) as answer:
            raw = await answer.read()
            elapsed = time.perf_counter() - started
            if answer.status != 200:
                raise RuntimeError(f"{url}: {answer.status} {raw[:300]!r}")
        return elapsed, orjson.loads(raw), dict(answer.headers)

    async def setup(self) -> None:
        messages = [{"role": role, "content": text} for role, text in self.turns]
        headers = {"x-api-key": KEY, "anthropic-beta": BETA, "content-type": "application/json"}
        _, reply, _ = await self._post(
            self.statestore + "/v1/messages",
            {"model": "echo-1", "max_tokens": 100, "thread": {"type": "create"}, "messages": [*messages, _user("go")]},
            headers,
        )
        self.thread_head = reply["id"]
        items = [_item(role, text) for role, text in self.turns]
        _, response, _ = await self._post(
            self.statestore + "/v1/responses", {"model": "echo-1", "input": [*items, _item("user", "go")]}, _bearer()
        )
        self.response_parent = self.response_head = response["id"]
        await self.response()  # the branch arm needs a parent that is not the head
        # The streamed continue's chain and the socket's: the same history, each its own head.
        for head in ("sse_head", "socket_head"):
            _, own, _ = await self._post(
                self.statestore + "/v1/responses",
                {"model": "echo-1", "input": [*items, _item("user", "go")]},
                _bearer(),
            )
            setattr(self, head, own["id"])
        self.socket = await self.http.ws_connect(
            self.statestore.replace("http://", "ws://") + "/v1/responses",
            headers=_bearer(),
            max_msg_size=0,
            compress=15 if self.offer_deflate else 0,
        )
        _, conversation, _ = await self._post(self.statestore + "/v1/conversations", {}, _bearer())
        self.conversation_id = conversation["id"]
        await self._post(
            self.statestore + "/v1/responses",
            {"model": "echo-1", "input": [*items, _item("user", "go")], "conversation": self.conversation_id},
            _bearer(),
        )

    def _new(self) -> str:
        self.n += 1
        return f"next question {self.n}: what about café ☕?"

    async def chat(self) -> float:
        messages = [{"role": role, "content": text} for role, text in self.turns]
        body = {"model": "echo-1", "messages": [*messages, _user(self._new())], "max_tokens": 100}
        elapsed, _, _ = await self._post(
            self.backend + "/v1/chat/completions", body, {"content-type": "application/json"}
        )
        return elapsed

    async def thread(self) -> float:
        headers = {"x-api-key": KEY, "anthropic-beta": BETA, "content-type": "application/json"}
        body = {
            "model": "echo-1",
            "max_tokens": 100,
            "thread": {"type": "continue", "previous_message_id": self.thread_head},
            "messages": [_user(self._new())],
        }
        elapsed, reply, _ = await self._post(self.statestore + "/v1/messages", body, headers)
        self.thread_head = reply["id"]
        return elapsed

    async def response(self) -> float:
        body = {"model": "echo-1", "input": self._new(), "previous_response_id": self.response_head}
        elapsed, reply, _ = await self._post(self.statestore + "/v1/responses", body, _bearer())
        self.response_parent, self.response_head = self.response_head, reply["id"]
        return elapsed

    async def response_sse(self) -> float:
        """The same continue streamed over HTTP: the time to its `response.completed`."""
        body = {"model": "echo-1", "input": self._new(), "previous_response_id": self.sse_head, "stream": True}
        started = time.perf_counter()
        async with self.http.post(self.statestore + "/v1/responses", data=orjson.dumps(body), headers=_bearer()) as sse:
            raw = await sse.read()
            elapsed = time.perf_counter() - started
            if sse.status != 200:
                raise RuntimeError(f"stream: {sse.status} {raw[:300]!r}")
        last = raw.rstrip().rsplit(b"\ndata: ", 1)[1]
        self.sse_head = orjson.loads(last)["response"]["id"]
        return elapsed

    async def socket_continue(self) -> float:
        """The same continue over one WebSocket (WebSocket mode): a response.create, its events to the last."""
        assert self.socket is not None
        event = {
            "type": "response.create",
            "model": "echo-1",
            "input": self._new(),
            "previous_response_id": self.socket_head,
        }
        started = time.perf_counter()
        await self.socket.send_str(orjson.dumps(event).decode())
        while True:
            message = orjson.loads(await self.socket.receive_str())
            if message["type"] == "response.completed":
                break
            if message["type"] == "error":
                raise RuntimeError(f"socket: {message}")
        elapsed = time.perf_counter() - started
        self.socket_head = message["response"]["id"]
        return elapsed

    async def conversation(self) -> float:
        body = {"model": "echo-1", "input": self._new(), "conversation": self.conversation_id}
        elapsed, _, _ = await self._post(self.statestore + "/v1/responses", body, _bearer())
        return elapsed

    async def branch(self) -> float:
        body = {"model": "echo-1", "input": self._new(), "previous_response_id": self.response_parent, "store": False}
        elapsed, _, _ = await self._post(self.statestore + "/v1/responses", body, _bearer())
        return elapsed


class DeepChain:
    """A chain `depth` responses deep of small turns, and its two arms: continue the head, regenerate below it."""

    def __init__(self, arms: Arms, depth: int) -> None:
        self.arms = arms
        self.depth = depth
        self.head = ""
        self.below_head = ""
        self.untouched: list[str] = []  # responses of the chain no turn has branched from yet, deepest last

    async def setup(self) -> None:
        previous: str | None = None
        for _ in range(self.depth):
            body: dict[str, Any] = {"model": "echo-1", "input": self.arms._new()}
            if previous is not None:
                body["previous_response_id"] = previous
            _, reply, _ = await self.arms._post(self.arms.statestore + "/v1/responses", body, _bearer())
            self.below_head, previous = previous or reply["id"], reply["id"]
            self.untouched.append(reply["id"])
        self.head = previous or ""
        # The deepest ones first; the head and the response below it are the other arms'.
        self.untouched = self.untouched[:-2]

    async def head_continue(self) -> float:
        body = {"model": "echo-1", "input": self.arms._new(), "previous_response_id": self.head}
        elapsed, reply, _ = await self.arms._post(self.arms.statestore + "/v1/responses", body, _bearer())
        self.head = reply["id"]
        return elapsed

    async def regenerate(self) -> float:
        body = {"model": "echo-1", "input": self.arms._new(), "previous_response_id": self.below_head}
        elapsed, _, _ = await self.arms._post(self.arms.statestore + "/v1/responses", body, _bearer())
        return elapsed

    async def first_branch(self) -> float:
        """A branch from a response no turn branched from before (its context read from the database), as deep as
        the chain still has one: the cold side of `regenerate`, which after its first turn reads a branch point."""
        at = self.untouched.pop() if len(self.untouched) > 1 else self.untouched[0]
        body = {"model": "echo-1", "input": self.arms._new(), "previous_response_id": at}
        elapsed, _, _ = await self.arms._post(self.arms.statestore + "/v1/responses", body, _bearer())
        return elapsed


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _item(role: str, text: str) -> dict[str, Any]:
    kind = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}


def _bearer() -> dict[str, str]:
    return {"authorization": f"Bearer {KEY}", "content-type": "application/json"}


Arm = Callable[[], Awaitable[float]]


async def measure(
    statestore: str,
    backend: str,
    rounds: int,
    meter: Meter,
    *,
    batch: int,
    depths: list[int],
    only: list[str],
    offer_deflate: bool = False,
) -> dict[str, dict[str, dict[str, float]]]:
    results: dict[str, dict[str, dict[str, float]]] = {}
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        for size_name, size in SIZES.items():
            arms = Arms(http, statestore, backend, history(size))
            arms.offer_deflate = offer_deflate
            await arms.setup()
            order: dict[str, Arm] = {
                "chat": arms.chat,
                "thread": arms.thread,
                "response": arms.response,
                "response-sse": arms.response_sse,
                "socket": arms.socket_continue,
                "conversation": arms.conversation,
                "branch": arms.branch,
            }
            if size_name == "2k":  # the deep chains are of small turns: once is enough
                for depth in depths:
                    chain = DeepChain(arms, depth)
                    await chain.setup()
                    order[f"head@{depth}"] = chain.head_continue
                    order[f"branch@{depth}"] = chain.regenerate
                    order[f"first-branch@{depth}"] = chain.first_branch
            names = [name for name in order if not only or name in only]
            samples: dict[str, list[float]] = {name: [] for name in names}
            bills: dict[str, list[Bill]] = {name: [] for name in names}
            for round_ in range(rounds + 2):
                for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                    # Rotated, so a slow stretch hits every arm.
                    before = meter.read()
                    elapsed = [await order[name]() for _ in range(batch)]
                    after = meter.read()
                    if round_ >= 2:  # two warm-up rounds
                        samples[name].extend(e * 1000 for e in elapsed)
                        bills[name].append(meter.bill(before, after, batch))
            if arms.socket is not None:
                await arms.socket.close()
            results[size_name] = {
                name: {
                    "p50_ms": statistics.median(values),
                    "p99_ms": percentile(values, 0.99),
                    "n": len(values),
                    **add(bills[name]).as_dict(),
                }
                for name, values in samples.items()
            }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.responses_arm", description=__doc__)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--batch", type=int, default=5, help="turns per billed batch (default 5)")
    parser.add_argument(
        "--depths", default="", help="chain depths for the head@D and branch@D arms, e.g. 20,200,1000 (default none)"
    )
    parser.add_argument(
        "--arms",
        default="",
        help="only these arms, e.g. response,response-sse,socket (default all); ratios are then to the first",
    )
    parser.add_argument(
        "--offer-deflate",
        action="store_true",
        help="the socket's client offers permessage-deflate, as the SDKs' do (statestore takes it up only with "
        "--set STATESTORE_SOCKET_COMPRESSION=true)",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="NAME=VALUE", help="a setting of the statestore server"
    )
    parser.add_argument(
        "--services",
        choices=("own", "shared"),
        default="own",
        help="own (default): a throwaway PostgreSQL cluster and redis-server of the run's own (bench/throwaway.py); "
        "shared: the ones STATESTORE_BENCH_PG and STATESTORE_BENCH_REDIS name, whose other users land on the bill",
    )
    args = parser.parse_args()
    depths = [int(d) for d in args.depths.split(",") if d]
    only = [arm for arm in args.arms.split(",") if arm]
    work = Path(tempfile.mkdtemp(prefix="statestore-bench-responses-"))
    backend_port, statestore_port = free_port(), free_port()
    backend_url, statestore_url = f"http://127.0.0.1:{backend_port}", f"http://127.0.0.1:{statestore_port}"
    with contextlib.ExitStack() as services:
        # Their own, unless told: the bill charges the turns whatever the services' processes do.
        if args.services == "own":
            admin_dsn = services.enter_context(postgres_cluster(work))
            redis_url = services.enter_context(redis_server(work))
        else:
            admin_dsn = os.environ.get("STATESTORE_BENCH_PG", DEFAULT_PG)
            redis_url = os.environ.get("STATESTORE_BENCH_REDIS", DEFAULT_REDIS)
        database = services.enter_context(scratch_database(admin_dsn))
        prefix = services.enter_context(redis_prefix(redis_url))
        env = _statestore_env(database, redis_url, prefix, backend_url, "WARNING")
        env["STATESTORE_CHAT_UPSTREAM_URL"] = backend_url
        env.update(setting.split("=", 1) for setting in args.set)
        backend = Service(
            "backend", [python(), "-m", "bench.backend", "--port", str(backend_port)], env=env, log_dir=work,
            health_url=backend_url + "/v1/models",
        )  # fmt: skip
        server: Service | None = None
        try:
            migrate = Service(
                "migrate", [python(), "-m", "statestore.cli", "migrate"], env=env, log_dir=work, health_url=""
            )
            if migrate.process.wait(timeout=120) != 0:
                raise RuntimeError(f"migrate failed:\n{migrate.log_tail()}")
            migrate.stop()
            server = Service(
                "statestore", [python(), "-m", "statestore.cli", "serve", "--port", str(statestore_port)], env=env,
                log_dir=work, health_url=statestore_url + "/healthz",
            )  # fmt: skip
            backend.wait_healthy()
            server.wait_healthy()
            meter = Meter([server.pid], admin_dsn, redis_url)
            meter.idle()
            results = asyncio.run(
                measure(
                    statestore_url,
                    backend_url,
                    args.rounds,
                    meter,
                    batch=args.batch,
                    depths=depths,
                    only=only,
                    offer_deflate=args.offer_deflate,
                )
            )
        finally:
            if server is not None:
                server.stop()
            backend.stop()
    (work / "results.json").write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    first = next(iter(next(iter(results.values()))))
    base = "thread" if not only or "thread" in only else first
    print(
        f"{'size':>6} {'arm':>12} {'p50 ms':>9} {'p99 ms':>9} {'p50/' + base:>11} "
        f"{'statestore us':>14} {'postgres us':>12} {'redis us':>9} {'total us':>9} {'total/' + base:>13}"
    )
    for size_name, arms in results.items():
        for arm, f in arms.items():
            thread = arms[base]
            print(
                f"{size_name:>6} {arm:>12} {f['p50_ms']:>9.2f} {f['p99_ms']:>9.2f} "
                f"{f['p50_ms'] / thread['p50_ms']:>11.2f} "
                f"{f['statestore_us']:>14.0f} {f['postgres_us']:>12.0f} {f['redis_us']:>9.0f} {f['total_us']:>9.0f} "
                f"{f['total_us'] / thread['total_us']:>13.2f}"
            )
        if "socket" in arms and "response-sse" in arms:  # WebSocket mode's own figure: its CPU to the same over SSE
            socket, sse = arms["socket"], arms["response-sse"]
            cpu, p50 = socket["statestore_us"] / sse["statestore_us"], socket["p50_ms"] / sse["p50_ms"]
            print(f"{size_name:>6} socket / response-sse: statestore CPU {cpu:.2f}x, p50 {p50:.2f}x")
    print(f"results: {work / 'results.json'}")


if __name__ == "__main__":
    main()
