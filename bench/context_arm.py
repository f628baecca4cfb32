"""Long conversations (docs/protocol.md §9), side by side in one run:

  * archive: a continue on a thread with about 10 MB archived and a 200 KB context, against a continue on a thread
    of 200 KB in all. A continue sends only the context, so both should cost the same latency and server CPU.
  * truncate: a continue whose estimate passes the trigger (a truncate step: the context's rows are read from
    PostgreSQL, their boundaries found, the base moved), against a continue whose Redis copy is gone (a cold rebuild
    of a context of the same size).

    make bench-context                        # or: .venv/bin/python -m bench.context_arm --turns 40

statestore (PostgreSQL + Redis) runs in front of the echo backend, on a scratch database and Redis prefix of this
run. Figures are ratios of medians measured in one run; the machine's load is printed with them.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import redis

from bench.harness import DEFAULT_PG, DEFAULT_REDIS, _statestore_env, redis_prefix, scratch_database
from bench.procs import REPO, Service, cpu_sample, free_port, load_average, python

BETA = "message-threads-2026-08-12"
ADMIN_TOKEN = "bench-admin-0123456789abcdef"
MAX_TOKENS = 64_000  # the echo cuts its reply to max_tokens x 4 bytes: room for 100 KB replies
ALWAYS_COMPACT = {"edits": [{"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 1}}]}


class Client:
    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=120.0)
        self.headers = {
            "x-api-key": "sk-bench-context",
            "anthropic-version": "2023-06-01",
            "anthropic-beta": BETA,
            "content-type": "application/json",
        }

    def turn(self, messages: list[dict[str, Any]], previous: str | None, **extra: Any) -> httpx.Response:
        thread = {"type": "create"} if previous is None else {"type": "continue", "previous_message_id": previous}
        body = {"model": "echo-1", "max_tokens": MAX_TOKENS, "messages": messages, "thread": thread, **extra}
        response = self.http.post("/v1/messages", content=orjson.dumps(body), headers=self.headers)
        if response.status_code != 200:
            raise RuntimeError(f"turn failed: {response.status_code} {response.text[:300]}")
        return response

    def info(self, thread_id: str) -> dict[str, Any]:
        info: dict[str, Any] = self.http.get(f"/statestore/v1/threads/{thread_id}", headers=self.headers).json()
        return info

    def policy(self, **values: Any) -> None:
        body = {
            "threads_enabled": True,
            "sessions_enabled": True,
            "default_ttl_seconds": 7200,
            "max_ttl_seconds": 86_400,
            "max_thread_bytes": 1 << 40,
            "max_messages": 1_000_000,
            **values,
        }
        auth = {"authorization": f"Bearer {ADMIN_TOKEN}", "content-type": "application/json"}
        self.http.put("/admin/v1/policies/default", content=orjson.dumps(body), headers=auth).raise_for_status()


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def filler(n_bytes: int, tag: str) -> str:
    unit = f"{tag} lorem ipsum dolor sit amet "
    return (unit * (n_bytes // len(unit) + 1))[:n_bytes]


def build_archived(client: Client, archive_bytes: int, context_bytes: int) -> tuple[str, str]:
    """A thread whose every turn compacts (the base moves past each reply) until `archive_bytes` are stored, then one
    turn that brings its context to about `context_bytes`: (thread id, head response id)."""
    half = context_bytes // 2
    response = client.turn([user(filler(half, "t0"))], None, context_management=ALWAYS_COMPACT)
    thread_id, previous = response.headers["statestore-thread-id"], response.json()["id"]
    turn = 1
    while client.info(thread_id)["bytes"] < archive_bytes:
        response = client.turn([user(filler(half, f"t{turn}"))], previous, context_management=ALWAYS_COMPACT)
        previous, turn = response.json()["id"], turn + 1
    response = client.turn([user(filler(half // 2, "last"))], previous)
    return thread_id, response.json()["id"]


def build_plain(client: Client, context_bytes: int) -> tuple[str, str]:
    response = client.turn([user(filler(context_bytes // 2, "plain"))], None)
    return response.headers["statestore-thread-id"], response.json()["id"]


def build_many_turns(client: Client, context_bytes: int, tag: str) -> tuple[str, str]:
    """A thread of many ~2 KB turns (many boundaries) of about `context_bytes` in all."""
    turns = max(2, context_bytes // 4000)
    messages: list[dict[str, Any]] = []
    for index in range(turns - 1):
        messages += [user(filler(2000, f"{tag}{index}")), {"role": "assistant", "content": filler(2000, "reply")}]
    messages.append(user(filler(2000, f"{tag}-last")))
    response = client.turn(messages, None)
    return response.headers["statestore-thread-id"], response.json()["id"]


def measure(
    client: Client, server_pid: int, thread: tuple[str, str], before: Callable[[], object] | None = None
) -> tuple[float, int]:
    """One continue: (wall seconds, server CPU ns)."""
    if before is not None:
        before()
    cpu = cpu_sample([server_pid]).sched_ns
    started = time.perf_counter()
    client.turn([user("ping")], thread[1])
    return time.perf_counter() - started, cpu_sample([server_pid]).sched_ns - cpu


def ratio(label: str, a: list[tuple[float, int]], b: list[tuple[float, int]], a_name: str, b_name: str) -> str:
    wall_a, wall_b = statistics.median(x[0] for x in a), statistics.median(x[0] for x in b)
    cpu_a, cpu_b = statistics.median(x[1] for x in a), statistics.median(x[1] for x in b)
    return (
        f"{label}: median latency {a_name} {wall_a * 1000:.1f} ms vs {b_name} {wall_b * 1000:.1f} ms "
        f"(x{wall_a / wall_b:.2f}); server CPU {cpu_a / 1e6:.1f} ms vs {cpu_b / 1e6:.1f} ms "
        f"(x{cpu_a / max(1, cpu_b):.2f})"
    )


def run(turns: int, archive_mb: float, context_kb: int, work: Path) -> list[str]:
    with scratch_database(DEFAULT_PG) as database, redis_prefix(DEFAULT_REDIS) as prefix:
        echo_port, port = free_port(), free_port()
        upstream = f"http://127.0.0.1:{echo_port}"
        env = _statestore_env(database, DEFAULT_REDIS, prefix, upstream, "WARNING")
        env["STATESTORE_ADMIN_TOKENS"] = f"bench:{ADMIN_TOKEN}"
        env["STATESTORE_POLICY_CACHE_SECONDS"] = "0"
        env["STATESTORE_MAX_BODY_BYTES"] = str(64 << 20)
        subprocess.run(
            [python(), "-m", "statestore.cli", "migrate"], env=env, cwd=REPO, check=True, capture_output=True
        )
        echo = Service(
            "echo",
            [python(), "-m", "statestore.cli", "echo-backend", "--port", str(echo_port)],
            env=env,
            log_dir=work,
            health_url=f"{upstream}/v1/models",
        )
        server = Service(
            "statestore",
            [python(), "-m", "statestore.cli", "serve", "--port", str(port)],
            env=env,
            log_dir=work,
            health_url=f"http://127.0.0.1:{port}/healthz",
        )
        try:
            echo.wait_healthy()
            server.wait_healthy()
            client = Client(f"http://127.0.0.1:{port}")
            client.policy(context_strategy="none")
            archived = build_archived(client, int(archive_mb * (1 << 20)), context_kb * 1024)
            info = client.info(archived[0])
            plain = build_plain(client, info["context"]["bytes"])
            plain_kb = client.info(plain[0])["bytes"] / 1024
            lines = [
                f"archived thread: {info['bytes'] / (1 << 20):.1f} MB archived, "
                f"{info['context']['bytes'] / 1024:.0f} KB context; plain thread: {plain_kb:.0f} KB"
            ]
            a: list[tuple[float, int]] = []
            b: list[tuple[float, int]] = []
            for _ in range(turns):
                a.append(measure(client, server.pid, archived))
                archived = (archived[0], client.info(archived[0])["head_message_id"])
                b.append(measure(client, server.pid, plain))
                plain = (plain[0], client.info(plain[0])["head_message_id"])
            lines.append(ratio("continue, 10 MB archived vs 200 KB thread", a, b, "archived", "plain"))

            cache = redis.Redis.from_url(DEFAULT_REDIS)
            window = int(context_kb * 1024 / 4 * 1.1)  # the thread's ~context_kb sits just past 0.8 x window
            steps: list[tuple[float, int]] = []
            cold: list[tuple[float, int]] = []
            for index in range(turns):
                client.policy(context_strategy="none")
                thread = build_many_turns(client, context_kb * 1024, f"c{index}")
                client.policy(context_strategy="none")
                keys = (f"{prefix}{{{thread[0]}}}:h", f"{prefix}{{{thread[0]}}}:n")
                cold.append(measure(client, server.pid, thread, functools.partial(cache.delete, *keys)))
                thread = build_many_turns(client, context_kb * 1024, f"s{index}")
                client.policy(context_strategy="truncate", context_window_tokens=window)
                steps.append(measure(client, server.pid, thread))
                if client.info(thread[0])["context"]["truncated"] != 1:
                    raise RuntimeError("the truncate arm's turn did not truncate")
            client.policy(context_strategy="none")
            cache.close()
            lines.append(ratio("truncate step vs cold rebuild", steps, cold, "truncate", "cold"))
            lines.append(f"load average {load_average():.1f}; {turns} turns per arm")
            return lines
        finally:
            server.stop()
            echo.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=30, help="measured continues per arm (default 30)")
    parser.add_argument("--archive-mb", type=float, default=10.0, help="archived size of the long thread (default 10)")
    parser.add_argument("--context-kb", type=int, default=200, help="context size (default 200)")
    args = parser.parse_args()
    work = Path(f"/tmp/statestore-bench-context-{time.strftime('%Y%m%d-%H%M%S')}")
    work.mkdir(parents=True, exist_ok=True)
    for line in run(args.turns, args.archive_mb, args.context_kb, work):
        print(line, flush=True)


if __name__ == "__main__":
    main()
