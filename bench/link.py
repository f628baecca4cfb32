"""`make bench-link`: the value of server-held state where users feel it, on a slow link (issue 23).

The client reaches statestore through a network namespace and a veth pair shaped with `tbf` at each rate (both
directions; netem is not available on every kernel, tbf is); statestore reaches its backend directly. For each history
size, a threaded continue (the client sends only the new turn) against the same turn sent with the whole history
straight to the backend: time to the first token and to the last byte, and the client's bytes per turn (echo backend).
Then, on llama.cpp's server (scripts/real-backend.sh), the time to first token of a continue whose rebuilt prefix is
byte-identical (the server's prompt cache hits) against one whose prefix changed.

    sudo make bench-link                          # 10, 50, 200 Mbit/s; 20k, 200k, 1M tokens; 5 turns each
    sudo .venv/bin/python -m bench.link --quick   # one rate, one size, two turns: does it run

Needs root (namespaces, tc), PostgreSQL and Redis as `make bench` does. Writes the figures, plots (PNG) and the
table to bench/link/ and the section of bench/README.md between its bench-link markers.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.harness import DEFAULT_PG, DEFAULT_REDIS, _statestore_env, redis_prefix, scratch_database
from bench.link_client import timed_post
from bench.procs import REPO, Service, free_port, python

BETA = "message-threads-2026-08-12"
KEY = "sk-bench-link"
BYTES_PER_TOKEN = 4  # the echo backend's count, and about English text's
OUT = REPO / "bench" / "link"
README = REPO / "bench" / "README.md"
BEGIN, END = "<!-- bench-link:begin -->", "<!-- bench-link:end -->"
HEADERS = {"x-api-key": KEY, "anthropic-version": "2023-06-01", "content-type": "application/json"}


def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=True, capture_output=True, text=True, **kwargs)


@dataclass(frozen=True)
class Link:
    namespace: str
    host_if: str
    inner_if: str
    host_ip: str

    def shape(self, mbit: int) -> None:
        """tbf on both ends of the pair: the client's uploads and its downloads each get `mbit`."""
        # A burst of at least rate/HZ, and a queue of 50 ms: the usual tbf sizing.
        burst = max(32, mbit * 1000 // 250 // 8)
        for prefix, device in (([], self.host_if), (["ip", "netns", "exec", self.namespace], self.inner_if)):
            run([*prefix, "tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate", f"{mbit}mbit",
                 "burst", f"{burst}kb", "latency", "50ms"])  # fmt: skip


@contextmanager
def shaped_link() -> Iterator[Link]:
    tag = secrets.token_hex(3)
    namespace, host_if, inner_if = f"sslink-{tag}", f"sl{tag}a", f"sl{tag}b"
    octet = int(tag[:2], 16) % 200 + 20
    host_ip, inner_ip = f"10.{octet}.77.1", f"10.{octet}.77.2"
    run(["ip", "netns", "add", namespace])
    try:
        run(["ip", "link", "add", host_if, "type", "veth", "peer", "name", inner_if])
        run(["ip", "link", "set", inner_if, "netns", namespace])
        run(["ip", "addr", "add", f"{host_ip}/30", "dev", host_if])
        run(["ip", "link", "set", host_if, "up"])
        inside = ["ip", "netns", "exec", namespace]
        run([*inside, "ip", "addr", "add", f"{inner_ip}/30", "dev", inner_if])
        run([*inside, "ip", "link", "set", inner_if, "up"])
        run([*inside, "ip", "link", "set", "lo", "up"])
        yield Link(namespace, host_if, inner_if, host_ip)
    finally:
        subprocess.run(["ip", "link", "del", host_if], check=False, capture_output=True)
        subprocess.run(["ip", "netns", "del", namespace], check=False, capture_output=True)


def filler(n_bytes: int, tag: str) -> str:
    unit = f"{tag} the quick brown fox jumps over the lazy dog "
    return (unit * (n_bytes // len(unit) + 1))[:n_bytes]


def client_turns(
    link: Link, url: str, turns: list[dict[str, Any]], previous: str | None, work: Path
) -> list[dict[str, Any]]:
    """The turns sent from inside the namespace, over the shaped link."""
    path = work / f"turns-{secrets.token_hex(4)}.jsonl"
    path.write_bytes(b"\n".join(orjson.dumps(turn) for turn in turns))
    argv = ["ip", "netns", "exec", link.namespace, python(), "-m", "bench.link_client", "--url", url, "--turns",
            str(path)] + (["--previous", previous] if previous else [])  # fmt: skip
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=3600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the client in the namespace failed:\n{done.stderr[-2000:]}")
    return [orjson.loads(line) for line in done.stdout.splitlines() if line.strip()]


def summary(results: list[dict[str, Any]]) -> dict[str, float]:
    return {
        "ttft": statistics.median(r["ttft"] for r in results),
        "total": statistics.median(r["total"] for r in results),
        "sent_bytes": statistics.median(r["sent_bytes"] for r in results),
    }


def echo_arms(rates: list[int], sizes: list[int], turns: int, work: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with scratch_database(DEFAULT_PG) as database, redis_prefix(DEFAULT_REDIS) as prefix, shaped_link() as link:
        echo_port, port = free_port(), free_port()
        env = _statestore_env(database, DEFAULT_REDIS, prefix, f"http://127.0.0.1:{echo_port}", "WARNING")
        env["STATESTORE_MAX_BODY_BYTES"] = str(64 << 20)
        run([python(), "-m", "statestore.cli", "migrate"], env=env, cwd=REPO)
        echo = Service("echo", [python(), "-m", "statestore.cli", "echo-backend", "--host", "0.0.0.0", "--port",
                                str(echo_port)], env=env, log_dir=work,
                       health_url=f"http://127.0.0.1:{echo_port}/v1/models")  # fmt: skip
        server = Service("statestore", [python(), "-m", "statestore.cli", "serve", "--host", "0.0.0.0", "--port",
                                        str(port)], env=env, log_dir=work,
                         health_url=f"http://127.0.0.1:{port}/healthz")  # fmt: skip
        try:
            echo.wait_healthy()
            server.wait_healthy()
            local = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600)
            for tokens in sizes:
                first = {"role": "user", "content": filler(tokens * BYTES_PER_TOKEN, "history")}
                created = local.post(
                    "/v1/messages",
                    content=orjson.dumps({"model": "echo-1", "max_tokens": 64, "messages": [first],
                                          "thread": {"type": "create"}}),
                    headers={**HEADERS, "anthropic-beta": BETA},
                )  # fmt: skip
                created.raise_for_status()
                head = created.json()["id"]
                history = [first, {"role": "assistant", "content": created.json()["content"]}]
                for mbit in rates:
                    link.shape(mbit)
                    threaded = [
                        {"path": "/v1/messages", "headers": {**HEADERS, "anthropic-beta": BETA}, "chain": True,
                         "body": {"model": "echo-1", "max_tokens": 64, "stream": True,
                                  "messages": [{"role": "user", "content": f"next {i}"}]}}
                        for i in range(turns)
                    ]  # fmt: skip
                    measured = client_turns(link, f"http://{link.host_ip}:{port}", threaded, head, work)
                    thread_id = created.headers["statestore-thread-id"]
                    head = local.get(f"/statestore/v1/threads/{thread_id}", headers=HEADERS).json()["head_message_id"]
                    whole = [
                        {"path": "/v1/messages", "headers": HEADERS,
                         "body": {"model": "echo-1", "max_tokens": 64, "stream": True,
                                  "messages": [*history, {"role": "user", "content": f"next {i}"}]}}
                        for i in range(turns)
                    ]  # fmt: skip
                    direct = client_turns(link, f"http://{link.host_ip}:{echo_port}", whole, None, work)
                    for arm, results in (("threaded", measured), ("whole history", direct)):
                        rows.append({"tokens": tokens, "mbit": mbit, "arm": arm, **summary(results)})
                        print(f"{tokens:>8} tokens {mbit:>4} Mbit/s {arm:>14}: {rows[-1]}", flush=True)
            local.close()
        finally:
            server.stop()
            echo.stop()
    return rows


def llama_arm(turns: int, work: Path) -> list[dict[str, Any]]:
    """TTFT on llama-server of a continue whose rebuilt prefix is byte-identical (prompt cache hit) against a turn
    whose prefix changed (the same history, its first message altered), unshaped: the server's own time."""
    built = run([str(REPO / "scripts" / "real-backend.sh"), python()], cwd=REPO)
    binary, model = built.stdout.strip().splitlines()[-2:]
    rows: list[dict[str, Any]] = []
    with scratch_database(DEFAULT_PG) as database, redis_prefix(DEFAULT_REDIS) as prefix:
        llama_port, port = free_port(), free_port()
        argv = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(llama_port), "-c", "8192", "-np", "1",
                "--jinja", "--temp", "0", "--no-webui"]  # fmt: skip
        health = f"http://127.0.0.1:{llama_port}/health"
        llama = Service("llama-server", argv, env=dict(os.environ), log_dir=work, health_url=health)
        env = _statestore_env(database, DEFAULT_REDIS, prefix, f"http://127.0.0.1:{llama_port}", "WARNING")
        run([python(), "-m", "statestore.cli", "migrate"], env=env, cwd=REPO)
        server = Service("statestore-llama", [python(), "-m", "statestore.cli", "serve", "--port", str(port)],
                         env=env, log_dir=work, health_url=f"http://127.0.0.1:{port}/healthz")  # fmt: skip
        try:
            llama.wait_healthy(60)
            server.wait_healthy()
            url = f"http://127.0.0.1:{port}"
            history = filler(20_000, "a long shared history")
            hits: list[dict[str, Any]] = []
            misses: list[dict[str, Any]] = []
            for index in range(turns):
                body = {"model": "tiny", "max_tokens": 8, "stream": True, "thread": {"type": "create"},
                        "messages": [{"role": "user", "content": history}]}  # fmt: skip
                created, head = timed_post(url, "/v1/messages", {**HEADERS, "anthropic-beta": BETA}, orjson.dumps(body))
                body = {"model": "tiny", "max_tokens": 8, "stream": True,
                        "thread": {"type": "continue", "previous_message_id": head},
                        "messages": [{"role": "user", "content": f"go on {index}"}]}  # fmt: skip
                hit, _ = timed_post(url, "/v1/messages", {**HEADERS, "anthropic-beta": BETA}, orjson.dumps(body))
                hits.append(hit)
                changed = {"model": "tiny", "max_tokens": 8, "stream": True,
                           "messages": [{"role": "user", "content": f"changed {index} " + history}]}  # fmt: skip
                miss, _ = timed_post(url, "/v1/messages", HEADERS, orjson.dumps(changed))
                misses.append(miss)
                if {created["status"], hit["status"], miss["status"]} != {200}:
                    errors = [turn.get("error") for turn in (created, hit, miss)]
                    raise RuntimeError(f"llama-server turns failed: {errors}")
            for arm, results in (("identical prefix", hits), ("changed prefix", misses)):
                rows.append({"arm": arm, **summary(results)})
                print(f"llama-server {arm}: {rows[-1]}", flush=True)
        finally:
            server.stop()
            llama.stop()
    return rows


def plots(rows: list[dict[str, Any]], llama: list[dict[str, Any]]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    OUT.mkdir(parents=True, exist_ok=True)
    names = []
    rates = sorted({row["mbit"] for row in rows})
    figure, axes = plt.subplots(1, len(rates), figsize=(4.5 * len(rates), 3.6), squeeze=False, sharey=True)
    for axis, mbit in zip(axes[0], rates, strict=True):
        for arm, style in (("threaded", "o-"), ("whole history", "s--")):
            points = sorted((r["tokens"], r["ttft"]) for r in rows if r["mbit"] == mbit and r["arm"] == arm)
            axis.plot([p[0] for p in points], [p[1] for p in points], style, label=arm)
        axis.set(xscale="log", yscale="log", title=f"{mbit} Mbit/s", xlabel="history (tokens)")
        axis.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("time to first token (s)")
    axes[0][0].legend()
    figure.tight_layout()
    figure.savefig(OUT / "ttft.png", dpi=110)
    names.append("ttft.png")
    figure, axis = plt.subplots(figsize=(5, 3.4))
    sizes = sorted({row["tokens"] for row in rows})
    for arm, style in (("threaded", "o-"), ("whole history", "s--")):
        points = [next(r["sent_bytes"] for r in rows if r["tokens"] == t and r["arm"] == arm) for t in sizes]
        axis.plot(sizes, points, style, label=arm)
    axis.set(xscale="log", yscale="log", xlabel="history (tokens)", ylabel="client bytes per turn")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(OUT / "bytes.png", dpi=110)
    names.append("bytes.png")
    if llama:
        figure, axis = plt.subplots(figsize=(4, 3.2))
        axis.bar([r["arm"] for r in llama], [r["ttft"] * 1000 for r in llama])
        axis.set(ylabel="time to first token (ms)", title="llama-server, 5k-token history")
        figure.tight_layout()
        figure.savefig(OUT / "llama-prefix.png", dpi=110)
        names.append("llama-prefix.png")
    plt.close("all")
    return names


def table(rows: list[dict[str, Any]], llama: list[dict[str, Any]], images: list[str]) -> str:
    lines = [
        BEGIN,
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} (medians; `make bench-link`).",
        "",
        "| history | link | arm | time to first token | last byte | client bytes per turn |",
        "|---:|---:|---|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['tokens']:,} tokens | {row['mbit']} Mbit/s | {row['arm']} | {row['ttft'] * 1000:,.0f} ms | "
            f"{row['total'] * 1000:,.0f} ms | {row['sent_bytes']:,.0f} |"
        )
    if llama:
        lines += ["", "| llama-server continue | time to first token |", "|---|---:|"]
        lines += [f"| {row['arm']} | {row['ttft'] * 1000:,.1f} ms |" for row in llama]
    lines += ["", *[f"![{name}](link/{name})" for name in images], END]
    return "\n".join(lines)


def write_readme(section: str) -> None:
    text = README.read_text()
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + section + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip("\n") + "\n\n## On a slow link\n\n" + section + "\n"
    README.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="50 Mbit/s, 20k tokens, 2 turns; no README update")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--no-llama", action="store_true", help="leave out the llama-server prompt-cache arm")
    args = parser.parse_args()
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        raise SystemExit("bench-link needs root and the ip and tc commands (iproute2): run it with sudo")
    rates, sizes, turns = (
        ([50], [20_000], 2) if args.quick else ([10, 50, 200], [20_000, 200_000, 1_000_000], args.turns)
    )
    work = Path(tempfile.mkdtemp(prefix="statestore-bench-link-"))
    print(f"logs in {work}", flush=True)
    rows = echo_arms(rates, sizes, turns, work)
    llama = [] if args.no_llama else llama_arm(turns, work)
    images = plots(rows, llama)
    section = table(rows, llama, images)
    (OUT / "results.json").write_bytes(orjson.dumps({"echo": rows, "llama": llama}, option=orjson.OPT_INDENT_2))
    if not args.quick:
        write_readme(section)
    print(section)


if __name__ == "__main__":
    main()
