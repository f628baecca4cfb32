"""Driving long conversations for the docs/protocol.md §9 tests (tests/integration/test_long_context.py): a restartable
server, and a thread or session driven turn by turn (the official SDK, or plain HTTP with keep-alive for the
1,000-turn runs), noting each turn's `statestore-context` header."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import anthropic
import httpx
import orjson
import redis
from anthropic.types.beta import BetaMessage, BetaMessageParam

from tests.support.admin_api import ADMIN_TOKENS, THREADS_BETA, AdminApi, policy, start_server
from tests.support.server import StatestoreServer

WINDOW = 20_000
TURNS = 1_000
# A turn's text in the 1,000-turn runs, in bytes: about 100 tokens with its echoed reply, so the base moves every 50 to
# 130 turns (by strategy) once the window is first filled, near turn 130; the moves are what those runs test.
TURN_BYTES = 200
MODEL = "claude-test-context"
SUMMARY_MARKER = "SUMMARISE-THE-CONVERSATION-ABOVE"
COMPACT_EDIT = {"edits": [{"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 16_000}}]}
SYSTEM = "You are a terse assistant."


def managed(strategy: str, **overrides: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "context_strategy": strategy,
        "context_window_tokens": WINDOW,
        "summary_instructions": f"{SUMMARY_MARKER}: write a short summary.",
    }
    return policy(**(values | overrides))


@dataclass
class Servers:
    """The module's server, restartable (same database and Redis prefix, new process)."""

    database_url: str
    backend_url: str
    redis_url: str
    prefix: str
    current: StatestoreServer = field(init=False)

    def __post_init__(self) -> None:
        self.current = self._start()

    def _start(self) -> StatestoreServer:
        return start_server(
            self.database_url,
            self.backend_url,
            self.redis_url,
            self.prefix,
            # A policy put through the server's admin API applies from its next turn: its policy cache is dropped.
            {"STATESTORE_ADMIN_TOKENS": ADMIN_TOKENS},
        )

    def restart(self) -> None:
        self.current.stop()
        self.current = self._start()

    def flush_redis(self) -> int:
        client = redis.Redis.from_url(self.redis_url)
        try:
            keys = list(client.scan_iter(match=self.prefix + "*", count=1000))
            if keys:
                client.delete(*keys)
            return len(keys)
        finally:
            client.close()

    def set_policy(self, values: dict[str, Any]) -> None:
        with AdminApi(self.current.url) as admin:
            admin.ok("PUT", "/policies/default", values)


@dataclass
class OneServer:
    """A server a test started and does not restart."""

    current: StatestoreServer


@dataclass
class Conversation:
    """One thread driven turn by turn through the SDK (keep-alive), noting each turn's statestore-context header."""

    servers: Servers | OneServer
    api_key: str
    session: str | None = None
    context_management: dict[str, Any] | None = None
    previous_id: str | None = None
    thread_id: str | None = None
    headers: list[dict[str, str]] = field(default_factory=list)
    _client: anthropic.Anthropic | None = None
    _http: httpx.Client | None = None

    def client(self) -> anthropic.Anthropic:
        if self._client is None or str(self._client.base_url).rstrip("/") != self.servers.current.url:
            self._client = anthropic.Anthropic(base_url=self.servers.current.url, api_key=self.api_key, max_retries=0)
        return self._client

    def send_fast(self, text: str) -> None:
        """A continue as plain HTTP with keep-alive: the same bytes the SDK sends, for the 1,000-turn runs."""
        if self._http is None or str(self._http.base_url).rstrip("/") != self.servers.current.url:
            self._http = httpx.Client(base_url=self.servers.current.url, timeout=30.0)
        creating = self.previous_id is None
        body: dict[str, Any] = {
            "model": MODEL,
            "max_tokens": 256,
            "messages": [{"role": "user", "content": text}],
            "thread": {"type": "create"} if creating else {"type": "continue", "previous_message_id": self.previous_id},
        }
        if creating:
            body["system"] = SYSTEM
        if self.context_management is not None:
            body["context_management"] = self.context_management
        response = self._http.post(
            "/v1/messages",
            content=orjson.dumps(body),
            headers={
                "x-api-key": self.api_key,
                "anthropic-version": "2023-06-01",
                "anthropic-beta": THREADS_BETA,
                "content-type": "application/json",
            },
        )
        assert response.status_code == 200, response.text
        self.previous_id = orjson.loads(response.content)["id"]
        self.thread_id = response.headers["statestore-thread-id"]
        names = ("statestore-context", "statestore-context-fallback")
        self.headers.append({name: response.headers[name] for name in names if name in response.headers})

    def send(self, text: str) -> BetaMessage:
        """A turn through the official SDK: a thread create or continue, or a session turn."""
        message = cast(BetaMessageParam, {"role": "user", "content": text})
        management: Any = self.context_management if self.context_management is not None else anthropic.omit
        if self.session is not None:
            raw = self.client().beta.messages.with_raw_response.create(
                model=MODEL,
                max_tokens=256,
                system=SYSTEM,
                messages=[message],
                context_management=management,
                extra_headers={"statestore-session-id": self.session},
            )
        else:
            creating = self.previous_id is None
            thread: Any = (
                {"type": "create"} if creating else {"type": "continue", "previous_message_id": self.previous_id}
            )
            raw = self.client().beta.messages.with_raw_response.create(
                model=MODEL,
                max_tokens=256,
                system=SYSTEM if creating else anthropic.omit,
                messages=[message],
                thread=thread,
                betas=[THREADS_BETA],
                context_management=management,
            )
        reply: BetaMessage = raw.parse()
        self.previous_id = reply.id
        self.thread_id = raw.headers["statestore-thread-id"]
        names = ("statestore-context", "statestore-context-fallback")
        self.headers.append({name: raw.headers[name] for name in names if name in raw.headers})
        return reply

    def moves(self, action: str) -> list[int]:
        return [turn for turn, headers in enumerate(self.headers) if headers.get("statestore-context") == action]

    def info(self) -> dict[str, Any]:
        assert self.thread_id is not None
        response = httpx.get(
            f"{self.servers.current.url}/statestore/v1/threads/{self.thread_id}", headers={"x-api-key": self.api_key}
        )
        assert response.status_code == 200, response.text
        info: dict[str, Any] = response.json()
        return info

    def view(self, which: str) -> dict[str, Any]:
        assert self.thread_id is not None
        response = httpx.get(
            f"{self.servers.current.url}/statestore/v1/threads/{self.thread_id}/messages",
            params={"view": which},
            headers={"x-api-key": self.api_key},
        )
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body


def words(turn: int, size: int = 40) -> str:
    text = f"turn {turn}: the quick brown fox jumps over the lazy dog "
    return (text * (size // len(text) + 1))[:size]
