"""statestore's value where users feel it: a client on a slow link (make bench-link).

The client runs in a network namespace of its own, reaching this host through a veth pair shaped with `tbf` in both
directions (netem is not available on this kernel; tbf is) at 10, 50 and 200 Mbit/s; statestore reaches the echo
backend over loopback, as it would sit next to its backend. Two arms, alternated turn by turn on the same link:

  * thread: a streamed threaded continue through statestore (the client sends only the new turn);
  * direct: the same conversation sent whole, straight to the backend, as a client without server-held state does.

With llama.cpp's llama-server built (scripts/real-backend.sh caches it in ~/.cache/statestore/llama/), a second
part puts statestore in front of it, on loopback, and compares the time to first token of a threaded continue, whose
rebuilt prefix is byte-identical to the request before (the server's prompt cache hits), with one whose prefix
changed (the same history sent statelessly with its first message altered, as a client that stamps its prompt does).

For 20k, 200k and 1M tokens of history (about 4 bytes a token) it reports the time to the first event of the reply
(the echo sends its first token with it), the time to the last byte, and the bytes the client moved per turn, then
draws them (PNG, matplotlib) for bench/README.md.

    make bench-link                                  # or: .venv/bin/python -m bench.link --turns 5
    .venv/bin/python -m bench.link --rates 10 --sizes 20000 --turns 2 --no-plots    # a smoke run

Needs root (ip netns, tc) and PostgreSQL and Redis as `make bench` does. It creates and removes its own namespace,
veth pair, scratch database and Redis prefix.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.harness import DEFAULT_PG, DEFAULT_REDIS, _statestore_env, redis_prefix, scratch_database
from bench.procs import REPO, Service, free_port, load_average, python
from bench.rawhttp import HttpConnection, render_request

BETA = "message-threads-2026-08-12"
ADMIN_TOKEN = "bench-admin-0123456789abcdef"
BYTES_PER_TOKEN = 4
REPLY_TOKENS = 64
HOST_ADDRESS, CLIENT_ADDRESS = "10.213.7.1", "10.213.7.2"
HEADERS = [
    ("x-api-key", "sk-bench-link"),
    ("anthropic-version", "2023-06-01"),
    ("anthropic-beta", BETA),
    ("content-type", "application/json"),
]


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def history(tokens: int) -> list[dict[str, Any]]:
    """About `tokens` of conversation in 2 KB turns, ending with the assistant's reply."""
    unit = "lorem ipsum dolor sit amet "
    text = (unit * (2000 // len(unit) + 1))[:2000]
    messages: list[dict[str, Any]] = []
    for index in range(max(1, tokens * BYTES_PER_TOKEN // 4000)):
        messages += [user(f"{index} {text}"), {"role": "assistant", "content": f"{index} {text}"}]
    return messages


# -- the link ---------------------------------------------------------------------------------------------------------


class Link:
    """A namespace for the client and a veth pair to it, shaped by tbf on both ends."""

    def __init__(self) -> None:
        tag = secrets.token_hex(3)
        self.namespace, self.host_side, self.client_side = f"sslink-{tag}", f"slh{tag}", f"slc{tag}"

    def __enter__(self) -> Link:
        for command in (
            f"ip netns add {self.namespace}",
            f"ip link add {self.host_side} type veth peer name {self.client_side}",
            f"ip link set {self.client_side} netns {self.namespace}",
            f"ip addr add {HOST_ADDRESS}/30 dev {self.host_side}",
            f"ip link set {self.host_side} up",
            f"ip -n {self.namespace} addr add {CLIENT_ADDRESS}/30 dev {self.client_side}",
            f"ip -n {self.namespace} link set {self.client_side} up",
            f"ip -n {self.namespace} link set lo up",
        ):
            subprocess.run(command.split(), check=True)
        return self

    def shape(self, mbit: int) -> None:
        # The bucket holds 2 ms at the rate (at least 16 KB, which tbf needs to reach the rate): a larger one lets a
        # whole small request through at once after an idle moment, and the link would not be the one named.
        burst = max(16 * 1024, mbit * 1_000_000 // 8 // 500)
        rule = f"root tbf rate {mbit}mbit burst {burst} latency 200ms"
        subprocess.run(f"tc qdisc replace dev {self.host_side} {rule}".split(), check=True)
        subprocess.run(
            f"ip netns exec {self.namespace} tc qdisc replace dev {self.client_side} {rule}".split(), check=True
        )

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["ip", "link", "del", self.host_side], check=False, capture_output=True)
        subprocess.run(["ip", "netns", "del", self.namespace], check=False, capture_output=True)


# -- the client, run inside the namespace -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sample:
    arm: str
    first_event_ms: float
    last_byte_ms: float
    client_bytes: int


async def _client(plan: dict[str, Any]) -> tuple[list[Sample], str]:
    """The turns of one point, alternating the arms; the thread's head after them."""
    host, port, echo_port = plan["host"], plan["port"], plan["echo_port"]
    thread_conn = await HttpConnection.open(host, port)
    direct_conn = await HttpConnection.open(host, echo_port)
    direct_body = orjson.dumps(
        {"model": "echo-1", "max_tokens": REPLY_TOKENS, "stream": True, "messages": plan["messages"] + [user("ping")]}
    )
    direct = render_request(host, echo_port, "/v1/messages", HEADERS, direct_body)
    previous = plan["head"]
    samples: list[Sample] = []
    for turn in range(plan["turns"]):
        body = {
            "model": "echo-1",
            "max_tokens": REPLY_TOKENS,
            "stream": True,
            "messages": [user(f"ping {turn}")],
            "thread": {"type": "continue", "previous_message_id": previous},
        }
        raw = render_request(host, port, "/v1/messages", HEADERS, orjson.dumps(body))
        reply = await thread_conn.request(raw)
        if reply.status != 200 or not reply.complete_stream() or reply.message_id() is None:
            raise RuntimeError(f"thread turn failed: {reply.status} {reply.head[:200]!r}")
        previous = reply.message_id() or previous
        samples.append(Sample("thread", reply.ttfb_ms, reply.total_ms, len(raw) + reply.body_bytes))
        reply = await direct_conn.request(direct)
        if reply.status != 200 or not reply.complete_stream():
            raise RuntimeError(f"direct turn failed: {reply.status} {reply.head[:200]!r}")
        samples.append(Sample("direct", reply.ttfb_ms, reply.total_ms, len(direct) + reply.body_bytes))
    thread_conn.close()
    direct_conn.close()
    return samples, previous


def client_main(plan_path: str) -> None:
    plan = orjson.loads(Path(plan_path).read_bytes())
    samples, head = asyncio.run(_client(plan))
    sys.stdout.buffer.write(orjson.dumps({"samples": [asdict(s) for s in samples], "head": head}))


# -- the run ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Point:
    mbit: int
    tokens: int
    arm: str
    first_event_ms: float
    last_byte_ms: float
    client_bytes: int


def _policy(http: httpx.Client) -> None:
    body = {
        "threads_enabled": True,
        "sessions_enabled": True,
        "default_ttl_seconds": 7200,
        "max_ttl_seconds": 86_400,
        "max_thread_bytes": 1 << 40,
        "max_messages": 1_000_000,
        "context_strategy": "none",
    }
    auth = {"authorization": f"Bearer {ADMIN_TOKEN}", "content-type": "application/json"}
    http.put("/admin/v1/policies/default", content=orjson.dumps(body), headers=auth).raise_for_status()


def _seed(http: httpx.Client, messages: list[dict[str, Any]]) -> str:
    """A thread holding `messages` and the echo's reply to one more user turn; the id to continue from."""
    body = {
        "model": "echo-1",
        "max_tokens": REPLY_TOKENS,
        "messages": [*messages, user("start")],
        "thread": {"type": "create"},
    }
    response = http.post("/v1/messages", content=orjson.dumps(body), headers=dict(HEADERS))
    if response.status_code != 200:
        raise RuntimeError(f"seeding failed: {response.status_code} {response.text[:300]}")
    message_id: str = response.json()["id"]
    return message_id


def run(rates: list[int], sizes: list[int], turns: int, work: Path) -> list[Point]:
    points: list[Point] = []
    with scratch_database(DEFAULT_PG) as database, redis_prefix(DEFAULT_REDIS) as prefix, Link() as link:
        echo_port, port = free_port(), free_port()
        env = _statestore_env(database, DEFAULT_REDIS, prefix, f"http://127.0.0.1:{echo_port}", "WARNING")
        env["STATESTORE_ADMIN_TOKENS"] = f"bench:{ADMIN_TOKEN}"
        env["STATESTORE_POLICY_CACHE_SECONDS"] = "0"
        env["STATESTORE_MAX_BODY_BYTES"] = str(64 << 20)
        subprocess.run(
            [python(), "-m", "statestore.cli", "migrate"], env=env, cwd=REPO, check=True, capture_output=True
        )
        # Both listen on every address: the client reaches them through the veth, statestore reaches the echo on
        # loopback.
        echo = Service(
            "echo",
            [python(), "-m", "statestore.cli", "echo-backend", "--host", "0.0.0.0", "--port", str(echo_port)],
            env=env,
            log_dir=work,
            health_url=f"http://127.0.0.1:{echo_port}/v1/models",
        )
        server = Service(
            "statestore",
            [python(), "-m", "statestore.cli", "serve", "--host", "0.0.0.0", "--port", str(port)],
            env=env,
            log_dir=work,
            health_url=f"http://127.0.0.1:{port}/healthz",
        )
        try:
            echo.wait_healthy()
            server.wait_healthy()
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as http:
                _policy(http)
                seeded = {tokens: history(tokens) for tokens in sizes}
                heads = {tokens: _seed(http, messages) for tokens, messages in seeded.items()}
            for mbit in rates:
                link.shape(mbit)
                for tokens in sizes:
                    messages = seeded[tokens]
                    plan = {
                        "host": HOST_ADDRESS,
                        "port": port,
                        "echo_port": echo_port,
                        "turns": turns,
                        "head": heads[tokens],
                        "messages": [*messages, user("start"), {"role": "assistant", "content": "start"}],
                    }
                    plan_path = work / f"plan-{mbit}-{tokens}.json"
                    plan_path.write_bytes(orjson.dumps(plan))
                    started = time.monotonic()
                    done = subprocess.run(
                        ["ip", "netns", "exec", link.namespace, python(), "-m", "bench.link", "client", str(plan_path)],
                        cwd=REPO,
                        check=True,
                        capture_output=True,
                    )
                    result = orjson.loads(done.stdout)
                    samples = [Sample(**s) for s in result["samples"]]
                    heads[tokens] = result["head"]
                    for arm in ("thread", "direct"):
                        mine = [s for s in samples if s.arm == arm]
                        points.append(
                            Point(
                                mbit,
                                tokens,
                                arm,
                                statistics.median(s.first_event_ms for s in mine),
                                statistics.median(s.last_byte_ms for s in mine),
                                int(statistics.median(s.client_bytes for s in mine)),
                            )
                        )
                    print(f"  {mbit} Mbit/s, {tokens} tokens: {time.monotonic() - started:.1f} s", file=sys.stderr)
        finally:
            server.stop()
            echo.stop()
    return points


LLAMA_CACHE = Path.home() / ".cache" / "statestore" / "llama" / "0.3.36"


def _real_backend() -> tuple[Path, Path]:
    """llama-server and the tiny model, from scripts/real-backend.sh (which builds what its cache lacks)."""
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "real-backend.sh"), python()],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    )
    binary, model = done.stdout.strip().splitlines()[-2:]
    return Path(binary), Path(model)


def _first_event(http: httpx.Client, body: dict[str, Any]) -> tuple[float, int, str | None]:
    """(ms to the first event, the prompt tokens the server read from its cache, the message id) of a stream."""
    started = time.perf_counter()
    first_ms, cached, message_id = 0.0, 0, None
    with http.stream("POST", "/v1/messages", content=orjson.dumps(body), headers=dict(HEADERS)) as response:
        if response.status_code != 200:
            raise RuntimeError(f"llama turn failed: {response.status_code} {response.read()[:300]!r}")
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if not first_ms:
                first_ms = (time.perf_counter() - started) * 1000
            event = orjson.loads(line[6:])
            if event.get("type") == "message_start":
                message_id = event["message"]["id"]
                cached = int(event["message"].get("usage", {}).get("cache_read_input_tokens") or 0)
    return first_ms, cached, message_id


def llama_arm(turns: int, work: Path, server_binary: Path, model: Path) -> list[str]:
    """Prompt-cache hits on llama-server: a threaded continue against a continue whose prefix changed."""
    lines: list[str] = []
    with scratch_database(DEFAULT_PG) as database, redis_prefix(DEFAULT_REDIS) as prefix:
        llama_port, port = free_port(), free_port()
        env = _statestore_env(database, DEFAULT_REDIS, prefix, f"http://127.0.0.1:{llama_port}", "WARNING")
        env["STATESTORE_ADMIN_TOKENS"] = f"bench:{ADMIN_TOKEN}"
        env["STATESTORE_POLICY_CACHE_SECONDS"] = "0"
        env["STATESTORE_UPSTREAM_READ_TIMEOUT"] = "300"
        subprocess.run(
            [python(), "-m", "statestore.cli", "migrate"], env=env, cwd=REPO, check=True, capture_output=True
        )
        # Two slots: each arm keeps its own prompt in one, so alternating the arms does not evict the other's cache.
        llama = Service(
            "llama-server",
            [str(server_binary), "-m", str(model), "--port", str(llama_port), "-c", "16384", "-np", "2", "--jinja"],
            env=env,
            log_dir=work,
            health_url=f"http://127.0.0.1:{llama_port}/health",
        )
        server = Service(
            "statestore",
            [python(), "-m", "statestore.cli", "serve", "--port", str(port)],
            env=env,
            log_dir=work,
            health_url=f"http://127.0.0.1:{port}/healthz",
        )
        try:
            llama.wait_healthy(timeout=120)
            server.wait_healthy()
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as http:
                _policy(http)
                words = " ".join(f"w{i} lorem ipsum dolor" for i in range(800))
                messages = [user(words), {"role": "assistant", "content": "noted"}]
                previous = _seed(http, messages)
                base = {"model": "tiny", "max_tokens": 4, "temperature": 0, "stream": True}
                hits: list[tuple[float, int]] = []
                misses: list[tuple[float, int]] = []
                for turn in range(turns + 1):
                    thread_body = {
                        **base,
                        "messages": [user(f"next {turn}")],
                        "thread": {"type": "continue", "previous_message_id": previous},
                    }
                    first_ms, cached, message_id = _first_event(http, thread_body)
                    previous = message_id or previous
                    changed = [user(f"[{time.time():.6f}] {words}"), *messages[1:], user(f"next {turn}")]
                    miss = _first_event(http, {**base, "messages": changed})
                    if turn:  # the first turn of each arm fills its slot's cache
                        hits.append((first_ms, cached))
                        misses.append((miss[0], miss[1]))
            lines.append(
                f"llama-server (tiny model, ~4.8k tokens of history, {turns} turns an arm, alternated): time to first "
                f"token p50 {statistics.median(h[0] for h in hits):.0f} ms on a threaded continue (prompt tokens read "
                f"from the server's cache, p50: {statistics.median(h[1] for h in hits):.0f}) against "
                f"{statistics.median(m[0] for m in misses):.0f} ms with the prefix changed "
                f"({statistics.median(m[1] for m in misses):.0f} from the cache): "
                f"x{statistics.median(m[0] for m in misses) / statistics.median(h[0] for h in hits):.1f}"
            )
        finally:
            server.stop()
            llama.stop()
    return lines


def table(points: list[Point]) -> list[str]:
    lines = [
        "| link | history | first event: thread | direct | ratio | last byte: thread | direct "
        "| client bytes/turn: thread | direct |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    by_key = {(p.mbit, p.tokens, p.arm): p for p in points}
    for mbit, tokens in sorted({(p.mbit, p.tokens) for p in points}):
        t, d = by_key[(mbit, tokens, "thread")], by_key[(mbit, tokens, "direct")]
        lines.append(
            f"| {mbit} Mbit/s | {tokens // 1000}k tokens | {t.first_event_ms:.1f} ms | {d.first_event_ms:.1f} ms "
            f"| {_times(d.first_event_ms / t.first_event_ms)} | {t.last_byte_ms:.1f} ms | {d.last_byte_ms:.1f} ms "
            f"| {_kb(t.client_bytes)} | {_kb(d.client_bytes)} |"
        )
    return lines


def _times(ratio: float) -> str:
    return f"{ratio:.1f}x" if ratio < 10 else f"{ratio:.0f}x"


def _kb(count: int) -> str:
    return f"{count / 1024:.1f} KB" if count < 1 << 20 else f"{count / (1 << 20):.1f} MB"


def plot(points: list[Point], out: Path) -> list[Path]:
    import matplotlib  # a dev dependency, only for the pictures

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    rates = sorted({p.mbit for p in points})
    figure, axes = plt.subplots(1, len(rates), figsize=(4 * len(rates), 3.6), sharey=True, squeeze=False)
    for axis, mbit in zip(axes[0], rates, strict=True):
        for arm, style in (("direct", "o--"), ("thread", "s-")):
            mine = sorted((p for p in points if p.mbit == mbit and p.arm == arm), key=lambda p: p.tokens)
            label = "whole history to the backend" if arm == "direct" else "threaded continue (statestore)"
            axis.plot([p.tokens for p in mine], [p.first_event_ms for p in mine], style, label=label)
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_title(f"{mbit} Mbit/s link")
        axis.set_xlabel("history (tokens)")
        axis.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("time to first event (ms, p50)")
    axes[0][0].legend(fontsize=8)
    figure.tight_layout()
    first = out / "link-first-event.png"
    figure.savefig(first, dpi=110)
    plt.close(figure)

    figure, axis = plt.subplots(figsize=(5, 3.6))
    for arm, style in (("direct", "o--"), ("thread", "s-")):
        mine = sorted((p for p in points if p.mbit == rates[0] and p.arm == arm), key=lambda p: p.tokens)
        axis.plot([p.tokens for p in mine], [p.client_bytes / 1024 for p in mine], style, label=arm)
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel("history (tokens)")
    axis.set_ylabel("client bytes per turn (KB)")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    second = out / "link-bytes.png"
    figure.savefig(second, dpi=110)
    plt.close(figure)
    return [first, second]


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["client"]:
        client_main(args[1])
        return
    parser = argparse.ArgumentParser(prog="python -m bench.link", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="10,50,200", help="link rates in Mbit/s (default 10,50,200)")
    parser.add_argument("--sizes", default="20000,200000,1000000", help="history sizes in tokens")
    parser.add_argument("--turns", type=int, default=5, help="turns per arm and point (default 5)")
    parser.add_argument("--plots", default=str(REPO / "bench" / "plots"), help="where the PNGs go")
    parser.add_argument("--no-plots", action="store_true", help="print the table only")
    parser.add_argument(
        "--llama",
        choices=("auto", "yes", "no"),
        default="auto",
        help="the llama-server prompt-cache part: auto runs it when scripts/real-backend.sh has built the server",
    )
    options = parser.parse_args(args)
    if os.geteuid() != 0 or shutil.which("tc") is None or shutil.which("ip") is None:
        parser.exit(2, "bench.link needs root and iproute2 (ip, tc): it makes a network namespace and shapes a link\n")
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"statestore-bench-link-{time.strftime('%Y%m%d-%H%M%S')}"
    work.mkdir(parents=True)
    rates = [int(r) for r in options.rates.split(",")]
    sizes = [int(s) for s in options.sizes.split(",")]
    print(
        f"bench.link: {rates} Mbit/s x {sizes} tokens x {options.turns} turns; load {load_average()}", file=sys.stderr
    )
    points = run(rates, sizes, options.turns, work)
    print("\n".join(table(points)))
    (work / "points.json").write_bytes(orjson.dumps([asdict(p) for p in points]))
    if not options.no_plots:
        for path in plot(points, Path(options.plots)):
            print(f"wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
    if options.llama == "yes" or (options.llama == "auto" and (LLAMA_CACHE / "llama-server").exists()):
        binary, model = _real_backend()
        print("\n".join(llama_arm(options.turns, work, binary, model)))
    elif options.llama == "auto":
        print(f"(no llama-server in {LLAMA_CACHE}: `make real-backend` builds it for the prompt-cache part)")
    print(f"load after: {load_average()}; raw figures in {work}", file=sys.stderr)


if __name__ == "__main__":
    main()
