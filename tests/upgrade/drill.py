"""The rolling upgrade drill: two replicas of the earlier release on PostgreSQL and Redis under the steady mixed
load (load.py); this version's `statestore migrate` while they serve; the replicas replaced one at a time, old and new
side by side; then one rolled back to the earlier release. Afterwards each conversation is continued once more on
each version, and three things are checked:

- no turn failed except on a replica while it was being stopped;
- every acknowledged turn is present (thread export, stored responses, conversation items) and continuable;
- every turn's backend request held exactly the conversation's acknowledged history before it, whichever version
  served it and whichever wrote the cache entry it read: no replica served a context it could not read.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.support.fake_backend import FakeBackend, RecordedRequest
from tests.support.server import StatestoreServer
from tests.upgrade.load import MESSAGES_HEADERS, OPENAI_HEADERS, Conversation, Load
from tests.upgrade.release import REPO, Release

# How many conversations the checks after the load continue or read back at once.
AT_ONCE = 6
REPLICA_SETTINGS = {"STATESTORE_LEASE_SECONDS": "5", "STATESTORE_LOG_LEVEL": "WARNING"}


@dataclass(frozen=True)
class Timing:
    warm_up: float  # the old release alone under load
    side_by_side: float  # old and new together, after the first replacement and after the rollback
    settle: float  # the new release alone
    # What each load worker waits between two turns. Unpaced, six workers keep both cores busy on their own (some
    # 7,000 turns in the short form), and every replica start and the migration then crawl: the short form paces its
    # load to a few hundred turns, ample for its checks; the full form keeps the load as heavy as the machine allows.
    pace: float


SHORT = Timing(warm_up=4, side_by_side=8, settle=4, pace=0.5)
FULL = Timing(warm_up=15, side_by_side=65, settle=15, pace=0.0)


@dataclass
class Replica:
    server: StatestoreServer
    version: str  # "old" or "new"
    stopping: tuple[float, float] | None = None  # when it was being stopped (monotonic)


@dataclass
class Drill:
    release: Release
    database_url: str
    redis_url: str
    redis_prefix: str
    backend: FakeBackend
    timing: Timing
    replicas: list[Replica] = field(default_factory=list)
    retired: list[Replica] = field(default_factory=list)
    log: list[str] = field(default_factory=list)

    def live(self) -> list[str]:
        return [replica.server.url for replica in self.replicas]

    def start(self, version: str) -> Replica:
        old = version == "old"
        server = StatestoreServer(
            database_url=self.database_url,
            upstream_url=self.backend.url,
            redis_url=self.redis_url,
            redis_prefix=self.redis_prefix,
            env={
                **REPLICA_SETTINGS,
                "STATESTORE_CHAT_UPSTREAM_URL": self.backend.url,
                **(self.release.env() if old else {}),
            },
            command=self.release.command() if old else None,
            cwd=REPO,
        )
        self.log.append(f"{time.monotonic():.1f} started {version} on {server.port}")
        return Replica(server, version)

    def replace(self, index: int, version: str) -> None:
        """Take replica `index` out of the rotation, stop it (gracefully, as an orchestrator does), start `version`."""
        replica = self.replicas[index]
        fresh = self.start(version)
        began = time.monotonic()
        self.replicas[index] = fresh
        replica.server.stop()
        replica.stopping = (began, time.monotonic())
        self.retired.append(replica)
        self.log.append(f"{time.monotonic():.1f} replaced {replica.version} on {replica.server.port} with {version}")

    def migrate(self) -> str:
        result = subprocess.run(
            [sys.executable, "-m", "statestore.cli", "migrate"],
            env={**_outside_env(), "STATESTORE_DATABASE_URL": self.database_url},
            capture_output=True,
            text=True,
            check=False,
            cwd=REPO,
        )
        assert result.returncode == 0, result.stderr
        self.log.append(f"{time.monotonic():.1f} migrated: {result.stdout.strip()}")
        return result.stdout

    def stop_all(self) -> None:
        for replica in self.replicas:
            replica.server.stop()


def _outside_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("STATESTORE_")}


async def run_drill(drill: Drill, migrate_old: Callable[[], None]) -> Load:
    """The whole drill; returns the load's record for `check`."""
    migrate_old()
    drill.replicas = list(await asyncio.gather(*(asyncio.to_thread(drill.start, "old") for _ in range(2))))
    load = Load(drill.live, pace=drill.timing.pace)
    stop = asyncio.Event()
    running = asyncio.create_task(load.run(stop))
    try:
        await asyncio.sleep(drill.timing.warm_up)
        await asyncio.to_thread(drill.migrate)
        await asyncio.sleep(1)
        await asyncio.to_thread(drill.replace, 0, "new")
        await asyncio.sleep(drill.timing.side_by_side)
        await asyncio.to_thread(drill.replace, 1, "new")
        await asyncio.sleep(drill.timing.settle)
        await asyncio.to_thread(drill.replace, 0, "old")
        await asyncio.sleep(drill.timing.side_by_side)
    finally:
        stop.set()
        await running
    await continue_each(load, drill)
    return load


async def continue_each(load: Load, drill: Drill) -> None:
    """One more turn of every conversation on each version (the two live replicas, one old and one new, in turn).
    The conversations go side by side: one after another, the drill's hundreds of them waited on a loaded machine."""
    urls = drill.live()
    slots = asyncio.Semaphore(AT_ONCE)

    async def go_on(http: httpx.AsyncClient, conversation: Conversation) -> None:
        async with slots:
            for round_, url in enumerate(urls):
                assert await load.turn(http, conversation, f"[{conversation.name}-final{round_}]", url), (
                    f"{conversation.kind} {conversation.name} could not be continued: {load.failures[-1]}"
                )

    async with httpx.AsyncClient(timeout=30) as http:
        await asyncio.gather(*(go_on(http, c) for c in load.conversations if c.uncertain is None and c.turns))


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def _history(request: RecordedRequest) -> list[tuple[str, str]]:
    messages = request.json()["messages"]
    return [(m["role"], _text(m["content"])) for m in messages if m["role"] in ("user", "assistant")]


def _expected(conversation: Conversation, upto: int) -> list[tuple[str, str]]:
    history: list[tuple[str, str]] = []
    for turn in conversation.turns[:upto]:
        history += [("user", f"turn {turn.marker}"), ("assistant", turn.reply)]
    return [*history, ("user", f"turn {conversation.turns[upto].marker}")]


def check_contexts(load: Load, requests: list[RecordedRequest]) -> list[str]:
    """Each acknowledged turn's backend request held exactly the history acknowledged before it."""
    by_marker: dict[str, RecordedRequest] = {}
    for request in requests:
        if request.path not in ("/v1/messages", "/v1/chat/completions"):
            continue
        history = _history(request)
        if history and history[-1][0] == "user":
            by_marker[history[-1][1].removeprefix("turn ")] = request
    wrong = []
    for conversation in load.conversations:
        for index, turn in enumerate(conversation.turns):
            seen = by_marker.get(turn.marker)
            if seen is None:
                wrong.append(f"{conversation.name} {turn.marker}: no backend request")
            elif _history(seen) != _expected(conversation, index):
                wrong.append(
                    f"{conversation.kind} {conversation.name} {turn.marker} on {turn.replica}: the backend got "
                    f"{len(_history(seen))} messages, expected {2 * index + 1}"
                )
    return wrong


def check_failures(load: Load, drill: Drill) -> list[str]:
    """Only a replica being stopped may cut a turn (a request it had taken when the stop began)."""
    stopping = {r.server.url: r.stopping for r in drill.retired if r.stopping is not None}
    allowed = []
    for failure in load.failures:
        window = stopping.get(failure.replica)
        if window is None or not window[0] - 1 <= failure.at <= window[1] + 1:
            allowed.append(f"{failure.kind} on {failure.replica} at {failure.at:.1f}: {failure.error}")
    return allowed


async def check_present(load: Load, url: str) -> list[str]:
    """Every acknowledged turn is stored, read back through the APIs (for the conversations cut short too)."""
    slots = asyncio.Semaphore(AT_ONCE)

    async def stored(http: httpx.AsyncClient, conversation: Conversation) -> str:
        async with slots:
            if conversation.kind in ("thread", "thread_stream", "session"):
                response = await http.get(
                    f"{url}/statestore/v1/threads/{conversation.thread_id}/messages", headers=MESSAGES_HEADERS
                )
                return response.text if response.status_code == 200 else ""
            if conversation.kind == "conversation":
                response = await http.get(
                    f"{url}/v1/conversations/{conversation.head}/items?limit=100", headers=OPENAI_HEADERS
                )
                return response.text if response.status_code == 200 else ""
            bodies = [
                await http.get(f"{url}/v1/responses/{turn.head}/input_items", headers=OPENAI_HEADERS)
                for turn in conversation.turns
            ]
            return "".join(body.text for body in bodies if body.status_code == 200)

    async with httpx.AsyncClient(timeout=30) as http:
        conversations = [conversation for conversation in load.conversations if conversation.turns]
        texts = await asyncio.gather(*(stored(http, conversation) for conversation in conversations))
    return [
        f"{conversation.kind} {conversation.name} {turn.marker}"
        for conversation, text in zip(conversations, texts, strict=True)
        for turn in conversation.turns
        if turn.marker not in text
    ]
