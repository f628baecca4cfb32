"""Clients for the scale-out tests: the official SDK with every response's status and replica recorded, and plain
httpx for the thread API and for raw thread turns."""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

import anthropic
import httpx
import httpx2
from anthropic.types.beta import BetaMessageParam

from tests.scaleout.processes import REPLICA_HEADER

MODEL = "echo-1"
THREADS_BETA = "message-threads-2026-08-12"


def user(text: str) -> BetaMessageParam:
    return {"role": "user", "content": text}


def new_api_key(label: str) -> str:
    """A credential of its own, so each conversation is its own owner (passthrough mode)."""
    return f"sk-scaleout-{label}-{secrets.token_hex(6)}"


@dataclass(frozen=True)
class Seen:
    """One HTTP response the SDK received (retries included), as seen on the wire."""

    method: str
    path: str
    status: int
    replica: str | None
    thread_id: str | None


@dataclass
class RecordingClient:
    """`anthropic.Anthropic` whose transport records every response: status, the replica HAProxy chose (the
    `x-statestore-replica` header it adds) and `statestore-thread-id`."""

    base_url: str
    api_key: str
    max_retries: int = 0
    seen: list[Seen] = field(default_factory=list)
    attempts: int = 0  # requests sent, retries included: more than len(seen) when some got no response at all

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self.http = httpx2.Client(
            event_hooks={"request": [self._count], "response": [self._record]},
            timeout=httpx2.Timeout(60.0, connect=5.0),
        )
        self.sdk = anthropic.Anthropic(
            base_url=self.base_url, api_key=self.api_key, max_retries=self.max_retries, http_client=self.http
        )

    def _count(self, request: httpx2.Request) -> None:
        with self._lock:
            self.attempts += 1

    def _record(self, response: httpx2.Response) -> None:
        seen = Seen(
            method=response.request.method,
            path=response.request.url.path,
            status=response.status_code,
            replica=response.headers.get(REPLICA_HEADER),
            thread_id=response.headers.get("statestore-thread-id"),
        )
        with self._lock:
            self.seen.append(seen)

    def turns(self) -> list[Seen]:
        """The responses to `POST /v1/messages`, in order."""
        return [s for s in self.seen if s.method == "POST" and s.path == "/v1/messages"]

    def close(self) -> None:
        self.sdk.close()
        self.http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class ThreadApi:
    """statestore's thread API (docs/protocol.md §7) and raw thread turns, for one owner, through `base_url`."""

    def __init__(self, base_url: str, api_key: str) -> None:
        self.http = httpx.Client(
            base_url=base_url,
            timeout=30.0,
            headers={"x-api-key": api_key, "anthropic-version": "2023-06-01", "anthropic-beta": THREADS_BETA},
        )

    def threads(self) -> list[dict[str, Any]]:
        response = self.http.get("/statestore/v1/threads", params={"limit": 1000})
        response.raise_for_status()
        data: list[dict[str, Any]] = response.json()["data"]
        return data

    def thread(self, thread_id: str) -> dict[str, Any]:
        response = self.http.get(f"/statestore/v1/threads/{thread_id}")
        response.raise_for_status()
        info: dict[str, Any] = response.json()
        return info

    def export(self, thread_id: str) -> dict[str, Any]:
        response = self.http.get(f"/statestore/v1/threads/{thread_id}/messages")
        response.raise_for_status()
        exported: dict[str, Any] = response.json()
        return exported

    def thread_with_head(self, head_message_id: str) -> dict[str, Any]:
        matches = [t for t in self.threads() if t["head_message_id"] == head_message_id]
        assert len(matches) == 1, f"expected one live thread with head {head_message_id}, found {matches}"
        return matches[0]

    def body(self, messages: list[BetaMessageParam], thread: dict[str, str], **fields: Any) -> dict[str, Any]:
        return {"model": MODEL, "max_tokens": 256, "messages": messages, "thread": thread, **fields}

    def create(self, text: str, **fields: Any) -> httpx.Response:
        return self.http.post("/v1/messages", json=self.body([user(text)], {"type": "create"}, **fields))

    def continue_(self, previous_message_id: str, text: str) -> httpx.Response:
        thread = {"type": "continue", "previous_message_id": previous_message_id}
        return self.http.post("/v1/messages", json=self.body([user(text)], thread))

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def error_code(response: httpx.Response) -> str | None:
    """`error.details.error_code` of an error response (docs/protocol.md §4), or None."""
    try:
        details = response.json().get("error", {}).get("details") or {}
    except ValueError:
        return None
    code = details.get("error_code")
    return code if isinstance(code, str) else None


def message_text(message: Any) -> tuple[str, str]:
    """(role, text) of a message as a request carries it: string content, or text blocks (dicts or SDK models)."""
    role = message["role"] if isinstance(message, dict) else message.role
    content = message["content"] if isinstance(message, dict) else message.content
    if isinstance(content, str):
        return role, content
    texts = []
    for block in content:
        kind = block["type"] if isinstance(block, dict) else block.type
        if kind == "text":
            texts.append(block["text"] if isinstance(block, dict) else block.text)
    return role, "".join(texts)
