"""Background responses (docs/responses.md, "Background responses") beside foreground ones, side by side in
one run, so the figures compare as ratios on whatever machine runs it.

    make bench-responses                                          # the Responses arm, then this one
    .venv/bin/python -m bench.background_arm --rounds 20          # quicker
    .venv/bin/python -m bench.background_arm --only cancel        # one phase

Three phases, each with its arms interleaved (rotated each round, so a slow stretch of the machine hits all of them):

turns   a continue of a chain (previous_response_id) at each --sizes history, one turn at a time, no backend delay.
        Every batch (--batch turns) continues a chain made for it just before (its create is neither timed nor
        billed), so the history stays the size asked. Each batch is billed (bench/bill.py): statestore's CPU,
        PostgreSQL's and Redis's per turn.
          fg-json       POST /v1/responses, JSON; timed to the end of the answer
          bg-json       the same with background: true (answered `queued`), then GET ?stream=true&starting_after=1
                        followed to its final event; timed from the create to the end of that stream. The final
                        event is published once the turn is stored, so it is the earliest moment a client can know
                        the response completed; polling GET would add its interval to the time and its requests to
                        the bill. The follow's own cost (a second request, its reads of the database and the
                        stream) is in the bill, as it is for a client that follows.
          bg-unfollowed background: true, nobody follows: the bench waits for the final event on the Redis Stream
                        itself (XREAD on the response's key), so statestore's column is the background turn alone
          fg-stream     stream: true, read to the end of the stream
          bg-stream     background: true and stream: true: the create answers with the events, live to the end
replay  finished background responses (a reply of some 20 events), `GET ?stream=true&starting_after=N` with N the
        middle event: time to the first bytes of the first event and to the end of the stream.
          redis         the events are in the Redis Stream
          storage       this bench deleted the response's Redis Stream (its own key, under its own prefix): what is
                        stored answers (for N past the start, the final Response alone)
          storage-all   the same, starting_after=1 (a client that saw nothing of the run: every event, rebuilt)
cancel  two statestore replicas on the same database and Redis prefix, their backend a slow echo (`statestore
        echo-backend --delay`) behind a TCP pass-through of this bench's that notes when each backend connection
        closes. A background turn is created on replica 1; once its backend request arrives, and a random
        0-250 ms later (the running replica looks for cancels every 0.25 s), it is cancelled through
          local         replica 1, the one running it
          remote        replica 2, which marks the row and waits for it to end
        timed from the cancel request to its answer (which must read `cancelled`) and to the backend connection
        closing.

Needs PostgreSQL and Redis as `make bench` does (STATESTORE_BENCH_PG / STATESTORE_BENCH_REDIS); the scratch
database and the Redis prefix are removed at the end. Prints tables (with the machine's load) and writes JSON to
$TMPDIR.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import random
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from redis import asyncio as aioredis

from bench.bill import Bill, Meter, add
from bench.harness import DEFAULT_PG, DEFAULT_REDIS, _statestore_env, machine, redis_prefix, scratch_database
from bench.procs import Service, free_port, python
from bench.responses_arm import SIZES, _bearer, _item, history, percentile

FINAL_EVENTS = (b"response.completed", b"response.incomplete", b"response.failed", b"response.cancelled")
TURN_ARMS = ("fg-json", "bg-json", "bg-unfollowed", "fg-stream", "bg-stream")
REPLAY_ARMS = ("redis", "storage", "storage-all")
CANCEL_ARMS = ("local", "remote")
# A user turn long enough that the echo's reply makes a stream of some 20 events (a few words per delta).
LONG_INPUT = " ".join(f"word{i} café ☕ and filler" for i in range(12))

Timed = Callable[[], Awaitable[float]]


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f}, {five:.2f}, {fifteen:.2f}"


def _events(body: bytes) -> list[tuple[bytes, dict[str, Any]]]:
    """(event type, data) of every SSE event in a body."""
    found: list[tuple[bytes, dict[str, Any]]] = []
    for block in body.split(b"\n\n"):
        kind = data = b""
        for line in block.split(b"\n"):
            if line.startswith(b"event: "):
                kind = line[7:]
            elif line.startswith(b"data: "):
                data = line[6:]
        if kind:
            found.append((kind, orjson.loads(data)))
    return found


def _final(body: bytes) -> tuple[bytes, dict[str, Any]]:
    events = _events(body)
    if not events or events[-1][0] not in FINAL_EVENTS:
        raise RuntimeError(f"stream did not end with a final event: {body[-300:]!r}")
    return events[-1]


@dataclass(slots=True)
class StreamRead:
    first_s: float  # the first body bytes, from the request's start
    end_s: float  # the end of the body
    body: bytes


class Client:
    """The bench's side of statestore's Responses door."""

    def __init__(self, http: aiohttp.ClientSession, url: str) -> None:
        self.http = http
        self.url = url

    async def post(self, path: str, body: Any) -> tuple[float, dict[str, Any]]:
        started = time.perf_counter()
        async with self.http.post(self.url + path, data=orjson.dumps(body), headers=_bearer()) as answer:
            raw = await answer.read()
            elapsed = time.perf_counter() - started
            if answer.status != 200:
                raise RuntimeError(f"POST {path}: {answer.status} {raw[:300]!r}")
        return elapsed, orjson.loads(raw)

    async def _read_stream(self, answer: aiohttp.ClientResponse, started: float, what: str) -> StreamRead:
        if answer.status != 200:
            raise RuntimeError(f"{what}: {answer.status} {(await answer.read())[:300]!r}")
        first = await answer.content.readany()
        first_s = time.perf_counter() - started
        rest = await answer.read()
        return StreamRead(first_s, time.perf_counter() - started, first + rest)

    async def post_stream(self, path: str, body: Any) -> StreamRead:
        started = time.perf_counter()
        async with self.http.post(self.url + path, data=orjson.dumps(body), headers=_bearer()) as answer:
            return await self._read_stream(answer, started, f"POST {path}")

    async def follow(self, response_id: str, after: int) -> StreamRead:
        started = time.perf_counter()
        path = f"/v1/responses/{response_id}?stream=true&starting_after={after}"
        async with self.http.get(self.url + path, headers=_bearer()) as answer:
            return await self._read_stream(answer, started, f"GET {path}")


class TurnArms:
    """The turns phase at one history size: each arm continues a chain of its own, made afresh for every batch."""

    def __init__(self, client: Client, events: aioredis.Redis, prefix: str, size_bytes: int) -> None:
        self.client = client
        self.events = events
        self.prefix = prefix
        self.items = [_item(role, text) for role, text in history(size_bytes)]
        self.head = ""
        self.n = 0
        self.create_s: list[float] = []  # bg-json's create alone (answered `queued`)

    async def new_chain(self) -> None:
        _, response = await self.client.post(
            "/v1/responses", {"model": "echo-1", "input": [*self.items, _item("user", "go")]}
        )
        self.head = response["id"]

    def _body(self, **extra: Any) -> dict[str, Any]:
        self.n += 1
        return {
            "model": "echo-1",
            "input": f"next question {self.n}: what about café ☕?",
            "previous_response_id": self.head,
            **extra,
        }

    async def fg_json(self) -> float:
        elapsed, response = await self.client.post("/v1/responses", self._body())
        self.head = response["id"]
        return elapsed

    async def bg_json(self) -> float:
        started = time.perf_counter()
        created, response = await self.client.post("/v1/responses", self._body(background=True))
        if response["status"] != "queued":
            raise RuntimeError(f"background create answered {response['status']}")
        self.create_s.append(created)
        followed = await self.client.follow(response["id"], 1)
        elapsed = time.perf_counter() - started
        _check_completed(followed.body)
        self.head = response["id"]
        return elapsed

    async def bg_unfollowed(self) -> float:
        started = time.perf_counter()
        _, response = await self.client.post("/v1/responses", self._body(background=True))
        await self._final_in_redis(response["id"])
        elapsed = time.perf_counter() - started
        self.head = response["id"]
        return elapsed

    async def _final_in_redis(self, response_id: str) -> None:
        key = f"{self.prefix}bg:{{{response_id}}}:events"  # statestore/store/event_log.py's key
        last = "0-0"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            found: Any = await self.events.xread({key: last}, count=100, block=1000)
            for _, entries in found:
                for entry_id, fields in entries:
                    last = entry_id.decode()
                    if fields.get(b"z") == b"1":
                        if not fields[b"f"].startswith(b"event: response.completed"):
                            raise RuntimeError(f"{response_id} ended: {fields[b'f'][:200]!r}")
                        return
        raise RuntimeError(f"{response_id}: no final event within 30 s")

    async def fg_stream(self) -> float:
        read = await self.client.post_stream("/v1/responses", self._body(stream=True))
        _check_completed(read.body)
        self.head = _events(read.body)[0][1]["response"]["id"]
        return read.end_s

    async def bg_stream(self) -> float:
        read = await self.client.post_stream("/v1/responses", self._body(stream=True, background=True))
        _check_completed(read.body)
        self.head = _events(read.body)[0][1]["response"]["id"]
        return read.end_s

    def arms(self) -> dict[str, Timed]:
        return {
            "fg-json": self.fg_json,
            "bg-json": self.bg_json,
            "bg-unfollowed": self.bg_unfollowed,
            "fg-stream": self.fg_stream,
            "bg-stream": self.bg_stream,
        }


def _check_completed(body: bytes) -> None:
    kind, data = _final(body)
    if kind != b"response.completed":
        raise RuntimeError(f"turn ended {kind!r}: {orjson.dumps(data)[:300]!r}")


def _rotated(names: list[str], round_: int) -> list[str]:
    at = round_ % len(names)
    return names[at:] + names[:at]


def _summary(values_s: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values_s]
    return {"p50_ms": statistics.median(ms), "p99_ms": percentile(ms, 0.99), "n": len(ms)}


async def measure_turns(
    client: Client,
    events: aioredis.Redis,
    prefix: str,
    meter: Meter,
    *,
    sizes: list[str],
    rounds: int,
    batch: int,
    settle_s: float,
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for size_name in sizes:
        arms = TurnArms(client, events, prefix, SIZES[size_name])
        order = arms.arms()
        names = list(order)
        samples: dict[str, list[float]] = {name: [] for name in names}
        bills: dict[str, list[Bill]] = {name: [] for name in names}
        load_before = _load()
        for round_ in range(rounds + 2):
            for name in _rotated(names, round_):
                await arms.new_chain()
                await asyncio.sleep(settle_s)
                before = meter.read()
                elapsed = [await order[name]() for _ in range(batch)]
                # A background turn's row is ended just after its final event: let it land in this batch's bill.
                await asyncio.sleep(settle_s)
                after = meter.read()
                if round_ >= 2:  # two warm-up rounds
                    samples[name].extend(elapsed)
                    bills[name].append(meter.bill(before, after, batch))
        results[size_name] = {
            "arms": {name: {**_summary(values), **add(bills[name]).as_dict()} for name, values in samples.items()},
            "bg_create": _summary(arms.create_s[2 * batch :]),
            "load": [load_before, _load()],
        }
    return results


async def measure_replay(client: Client, redis_url: str, prefix: str, *, count: int) -> dict[str, Any]:
    """Finished background responses, resumed from the middle: from Redis, and from storage."""
    kept: list[str] = []
    gone: list[str] = []
    last_seq = 0
    for target in (kept, gone):
        for _ in range(4):
            _, response = await client.post(
                "/v1/responses", {"model": "echo-1", "input": LONG_INPUT, "background": True}
            )
            read = await client.follow(response["id"], -1)
            _check_completed(read.body)
            last_seq = int(_final(read.body)[1]["sequence_number"])
            target.append(response["id"])
    middle = last_seq // 2
    redis = aioredis.Redis.from_url(redis_url)
    try:
        deleted = await redis.delete(*[f"{prefix}bg:{{{response_id}}}:events" for response_id in gone])
    finally:
        await redis.aclose()
    if deleted != len(gone):
        raise RuntimeError(f"expected to delete {len(gone)} event streams, deleted {deleted}")
    starts = {"redis": (kept, middle), "storage": (gone, middle), "storage-all": (gone, 1)}
    first: dict[str, list[float]] = {name: [] for name in REPLAY_ARMS}
    end: dict[str, list[float]] = {name: [] for name in REPLAY_ARMS}
    events_seen: dict[str, int] = {}
    load_before = _load()
    for round_ in range(count + 1):
        for name in _rotated(list(REPLAY_ARMS), round_):
            ids, after = starts[name]
            read = await client.follow(ids[round_ % len(ids)], after)
            events = _events(read.body)
            if int(events[0][1]["sequence_number"]) <= after or events[-1][0] != b"response.completed":
                raise RuntimeError(f"{name}: unexpected replay {read.body[:300]!r}")
            events_seen[name] = len(events)
            if round_ >= 1:  # one warm-up round
                first[name].append(read.first_s)
                end[name].append(read.end_s)
    return {
        "events": last_seq + 1,
        "starting_after": {name: starts[name][1] for name in REPLAY_ARMS},
        "events_replayed": events_seen,
        "first": {name: _summary(values) for name, values in first.items()},
        "end": {name: _summary(values) for name, values in end.items()},
        "load": [load_before, _load()],
    }


# -- the cancel phase ----------------------------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class Passage:
    """One connection through the pass-through: when a request arrived on it, when statestore's side closed."""

    requested: asyncio.Event = field(default_factory=asyncio.Event)
    closed_at: float | None = None
    closed: asyncio.Event = field(default_factory=asyncio.Event)


class WatchedPassThrough:
    """A TCP pass-through in front of the slow backend that notes when statestore closes each connection (the
    backend's view of a cancel reaching it)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.requests: asyncio.Queue[Passage] = asyncio.Queue()
        self._server: asyncio.Server | None = None

    async def start(self, port: int) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", port)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        passage = Passage()
        backend_reader, backend_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def upward() -> None:
            with contextlib.suppress(ConnectionError):
                while data := await reader.read(65536):
                    if data.startswith(b"POST "):
                        passage.requested.set()
                        self.requests.put_nowait(passage)
                    backend_writer.write(data)
                    await backend_writer.drain()
            passage.closed_at = time.perf_counter()
            passage.closed.set()
            backend_writer.close()

        async def downward() -> None:
            with contextlib.suppress(ConnectionError):
                while data := await backend_reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            writer.close()

        up = asyncio.create_task(upward())
        down = asyncio.create_task(downward())
        await up
        down.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await down
        writer.close()

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)


async def measure_cancel(
    running: Client, other: Client, proxy: WatchedPassThrough, *, count: int, seed: int
) -> dict[str, Any]:
    rng = random.Random(seed)
    answered: dict[str, list[float]] = {name: [] for name in CANCEL_ARMS}
    closed: dict[str, list[float]] = {name: [] for name in CANCEL_ARMS}
    through = {"local": running, "remote": other}
    load_before = _load()
    for round_ in range(count + 1):
        for name in _rotated(list(CANCEL_ARMS), round_):
            while not proxy.requests.empty():
                proxy.requests.get_nowait()
            _, response = await running.post(
                "/v1/responses", {"model": "echo-1", "input": "a long job", "background": True}
            )
            passage = await asyncio.wait_for(proxy.requests.get(), 10)
            await asyncio.sleep(rng.uniform(0.0, 0.25))
            started = time.perf_counter()
            answer_s, ended = await through[name].post(f"/v1/responses/{response['id']}/cancel", {})
            if ended["status"] != "cancelled":
                raise RuntimeError(f"cancel through {name} answered {ended['status']}")
            await asyncio.wait_for(passage.closed.wait(), 10)
            assert passage.closed_at is not None
            if round_ >= 1:  # one warm-up round
                answered[name].append(answer_s)
                closed[name].append(passage.closed_at - started)
    return {
        "answered": {name: _summary(values) for name, values in answered.items()},
        "backend_closed": {name: _summary(values) for name, values in closed.items()},
        "load": [load_before, _load()],
    }


@contextlib.contextmanager
def _services(*services: Service) -> Iterator[None]:
    try:
        yield
    finally:
        for service in reversed(services):
            service.stop()


def _migrate(env: dict[str, str], work: Path) -> None:
    migrate = Service("migrate", [python(), "-m", "statestore.cli", "migrate"], env=env, log_dir=work, health_url="")
    if migrate.process.wait(timeout=120) != 0:
        raise RuntimeError(f"migrate failed:\n{migrate.log_tail()}")
    migrate.stop()


def _replica(name: str, env: dict[str, str], work: Path) -> tuple[Service, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    service = Service(
        name, [python(), "-m", "statestore.cli", "serve", "--port", str(port)], env=env, log_dir=work,
        health_url=url + "/healthz",
    )  # fmt: skip
    return service, url


async def _turns_and_replay(
    url: str, redis_url: str, prefix: str, meter: Meter, args: argparse.Namespace, phases: set[str]
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        client = Client(http, url)
        if "turns" in phases:
            events = aioredis.Redis.from_url(redis_url)
            try:
                results["turns"] = await measure_turns(
                    client,
                    events,
                    prefix,
                    meter,
                    sizes=args.sizes.split(","),
                    rounds=args.rounds,
                    batch=args.batch,
                    settle_s=args.settle_ms / 1000,
                )
            finally:
                await events.aclose()
        if "replay" in phases:
            results["replay"] = await measure_replay(client, redis_url, prefix, count=args.replays)
    return results


async def _cancel(env: dict[str, str], work: Path, args: argparse.Namespace) -> dict[str, Any]:
    slow_port, proxy_port = free_port(), free_port()
    slow = Service(
        "slow-backend",
        [python(), "-m", "statestore.cli", "echo-backend", "--port", str(slow_port), "--delay", str(args.slow_delay)],
        env=env, log_dir=work, health_url=f"http://127.0.0.1:{slow_port}/v1/models",
    )  # fmt: skip
    proxy = WatchedPassThrough(slow_port)
    await proxy.start(proxy_port)
    slow_env = env | {"STATESTORE_CHAT_UPSTREAM_URL": f"http://127.0.0.1:{proxy_port}"}
    one, one_url = _replica("replica-1", slow_env, work)
    two, two_url = _replica("replica-2", slow_env, work)
    try:
        with _services(slow, one, two):
            for service in (slow, one, two):
                await asyncio.to_thread(service.wait_healthy)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
                return await measure_cancel(
                    Client(http, one_url), Client(http, two_url), proxy, count=args.cancels, seed=args.seed
                )
    finally:
        await proxy.aclose()


def _print(results: dict[str, Any]) -> None:
    about = results["machine"]
    print(f"{about['date']}, commit {about['commit']}, {about['cores']} cores ({about['cpu_model']})")
    for size_name, found in results.get("turns", {}).items():
        arms = found["arms"]
        print(f"\nturns at {size_name} (load {found['load'][0]} -> {found['load'][1]}):")
        print(
            f"{'arm':>14} {'p50 ms':>8} {'p99 ms':>8} {'statestore us':>14} {'postgres us':>12} {'redis us':>9} "
            f"{'total us':>9} {'p50/fg':>7} {'cpu/fg':>7} {'total/fg':>9}"
        )
        for name, f in arms.items():
            base = arms["fg-stream" if "stream" in name else "fg-json"]
            print(
                f"{name:>14} {f['p50_ms']:>8.2f} {f['p99_ms']:>8.2f} {f['statestore_us']:>14.0f} "
                f"{f['postgres_us']:>12.0f} {f['redis_us']:>9.0f} {f['total_us']:>9.0f} "
                f"{f['p50_ms'] / base['p50_ms']:>7.2f} {f['statestore_us'] / base['statestore_us']:>7.2f} "
                f"{f['total_us'] / base['total_us']:>9.2f}"
            )
        create = found["bg_create"]
        print(f"{'(bg create)':>14} {create['p50_ms']:>8.2f} {create['p99_ms']:>8.2f}   the create alone, `queued`")
    replay = results.get("replay")
    if replay is not None:
        print(
            f"\nreplay of a finished background response of {replay['events']} events "
            f"(load {replay['load'][0]} -> {replay['load'][1]}):"
        )
        print(
            f"{'arm':>12} {'after':>6} {'events':>7} {'first p50':>10} {'first p99':>10} {'end p50':>9} {'end p99':>9}"
        )
        for name in REPLAY_ARMS:
            first, end = replay["first"][name], replay["end"][name]
            print(
                f"{name:>12} {replay['starting_after'][name]:>6} {replay['events_replayed'][name]:>7} "
                f"{first['p50_ms']:>10.2f} {first['p99_ms']:>10.2f} {end['p50_ms']:>9.2f} {end['p99_ms']:>9.2f}"
            )
    cancel = results.get("cancel")
    if cancel is not None:
        print(f"\ncancel (load {cancel['load'][0]} -> {cancel['load'][1]}), ms from the cancel request:")
        print(f"{'through':>8} {'answered p50':>13} {'p99':>8} {'backend closed p50':>19} {'p99':>8} {'n':>4}")
        for name in CANCEL_ARMS:
            answered, closed = cancel["answered"][name], cancel["backend_closed"][name]
            print(
                f"{name:>8} {answered['p50_ms']:>13.1f} {answered['p99_ms']:>8.1f} {closed['p50_ms']:>19.1f} "
                f"{closed['p99_ms']:>8.1f} {answered['n']:>4}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.background_arm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=40, help="rounds of the turns phase, per size (default 40)")
    parser.add_argument("--batch", type=int, default=5, help="turns per billed batch (default 5)")
    parser.add_argument("--sizes", default="2k,200k", help=f"history sizes, of {','.join(SIZES)} (default 2k,200k)")
    parser.add_argument("--replays", type=int, default=30, help="resumed streams per replay arm (default 30)")
    parser.add_argument("--cancels", type=int, default=30, help="cancels per cancel arm (default 30)")
    parser.add_argument(
        "--slow-delay", type=float, default=30.0, help="the slow backend's delay, seconds, for the cancel phase"
    )
    parser.add_argument(
        "--settle-ms", type=float, default=20.0, help="pause before each batch's closing meter reading (default 20)"
    )
    parser.add_argument("--only", default="turns,replay,cancel", help="phases to run (default turns,replay,cancel)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the cancel phase's random offsets")
    args = parser.parse_args()
    phases = set(args.only.split(","))
    unknown = phases - {"turns", "replay", "cancel"} | set(args.sizes.split(",")) - set(SIZES)
    if unknown:
        parser.error(f"unknown phase or size: {', '.join(sorted(unknown))}")
    admin_dsn = os.environ.get("STATESTORE_BENCH_PG", DEFAULT_PG)
    redis_url = os.environ.get("STATESTORE_BENCH_REDIS", DEFAULT_REDIS)
    work = Path(tempfile.mkdtemp(prefix="statestore-bench-background-"))
    results: dict[str, Any] = {"machine": dataclasses.asdict(machine())}
    with scratch_database(admin_dsn) as database, redis_prefix(redis_url) as prefix:
        backend_port = free_port()
        backend_url = f"http://127.0.0.1:{backend_port}"
        env = _statestore_env(database, redis_url, prefix, backend_url, "WARNING")
        env["STATESTORE_CHAT_UPSTREAM_URL"] = backend_url
        _migrate(env, work)
        if phases & {"turns", "replay"}:
            backend = Service(
                "backend", [python(), "-m", "bench.backend", "--port", str(backend_port)], env=env, log_dir=work,
                health_url=backend_url + "/v1/models",
            )  # fmt: skip
            server, url = _replica("statestore", env, work)
            with _services(backend, server):
                backend.wait_healthy()
                server.wait_healthy()
                meter = Meter([server.pid], admin_dsn, redis_url)
                meter.idle()
                results |= asyncio.run(_turns_and_replay(url, redis_url, prefix, meter, args, phases))
        if "cancel" in phases:
            results["cancel"] = asyncio.run(_cancel(env, work, args))
    (work / "results.json").write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    _print(results)
    print(f"results: {work / 'results.json'}")


if __name__ == "__main__":
    main()
