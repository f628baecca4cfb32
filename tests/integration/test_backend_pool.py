"""Waiting for a backend connection is bounded (STATESTORE_UPSTREAM_POOL_TIMEOUT_SECONDS): with every connection to
the backend in use, a turn gives up after the pool timeout with a 503 and `retry-after` in its door's shape, its
request unsent, and its thread or conversation released at once (not held for the lease's 120 s): the same turn
succeeds as soon as a connection is free. Both doors, both storage set-ups."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.support.admin_api import MODEL, user
from tests.support.fake_backend import FakeBackend
from tests.support.server import StatestoreServer

POOL_TIMEOUT = 0.5
HOLD_SECONDS = 3.0
CHAT_PATH = "/v1/chat/completions"


@pytest.fixture(scope="module", params=["postgres", "sqlite"])
def pool_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, fake_backend_process: FakeBackend
) -> Iterator[StatestoreServer]:
    """statestore with one connection to each backend, and a short wait for it."""
    env = {
        "STATESTORE_CHAT_UPSTREAM_URL": fake_backend_process.url,
        "STATESTORE_UPSTREAM_MAX_CONNECTIONS": "1",
        "STATESTORE_UPSTREAM_POOL_TIMEOUT_SECONDS": str(POOL_TIMEOUT),
    }
    if request.param == "postgres":
        url: str = request.getfixturevalue("private_pg_url")
        redis_url: str = request.getfixturevalue("redis_url")
        prefix: str = request.getfixturevalue("server_redis_prefix")
        server = StatestoreServer(
            database_url=url, upstream_url=fake_backend_process.url, redis_url=redis_url, redis_prefix=prefix, env=env
        )
    else:
        from statestore.store.migrate import upgrade

        path: Path = tmp_path_factory.mktemp("pool") / "statestore.db"
        upgrade(f"sqlite+aiosqlite:///{path}")
        server = StatestoreServer(
            database_url=f"sqlite+aiosqlite:///{path}", upstream_url=fake_backend_process.url, env=env
        )
    yield server
    server.stop()


def _holding(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run `call` (a request the backend holds for HOLD_SECONDS) in the background."""
    out: list[Any] = []
    worker = threading.Thread(target=lambda: out.append(call()))
    worker.start()
    return worker, out


def _wait_for_requests(backend: FakeBackend, count: int) -> None:
    deadline = time.monotonic() + 10
    while len(backend.requests()) < count:
        assert time.monotonic() < deadline, "the held request never reached the backend"
        time.sleep(0.02)


def test_a_thread_turn_waiting_for_a_connection_gives_up_and_releases_its_thread(
    pool_server: StatestoreServer, backend: FakeBackend, api_key: str
) -> None:
    with anthropic.Anthropic(base_url=pool_server.url, api_key=api_key, max_retries=0) as sdk:
        waiting = sdk.beta.messages.thread(model=MODEL, max_tokens=64)
        waiting.send(user("first turn"))
        before = waiting.previous_message_id
        holder = sdk.beta.messages.thread(model=MODEL, max_tokens=64)
        backend.script({"kind": "echo", "match": "hold the only connection", "delay_seconds": HOLD_SECONDS})
        seen = len(backend.requests())
        worker, _ = _holding(lambda: holder.send(user("hold the only connection")))
        _wait_for_requests(backend, seen + 1)

        started = time.monotonic()
        with pytest.raises(anthropic.APIStatusError) as refused:
            waiting.send(user("second turn"))
        elapsed = time.monotonic() - started
        assert POOL_TIMEOUT * 0.8 <= elapsed < HOLD_SECONDS - 0.5
        assert refused.value.status_code == 503
        assert refused.value.response.headers.get("retry-after")
        body = refused.value.response.json()
        assert body["type"] == "error" and body["error"]["type"] == "api_error"
        assert "in use" in body["error"]["message"]
        assert len(backend.requests()) == seen + 1  # the refused turn was not sent
        assert waiting.previous_message_id == before
        worker.join()

        # Released: the thread continues from the same head now, well within its lease.
        again = sdk.beta.messages.create(
            model=MODEL,
            max_tokens=64,
            messages=[user("second turn")],
            extra_body={"thread": {"type": "continue", "previous_message_id": before}},
            extra_headers={"anthropic-beta": "message-threads-2026-08-12"},
        )
        assert again.id != before


def test_a_responses_turn_waiting_for_a_connection_gives_up_and_releases_its_conversation(
    pool_server: StatestoreServer, backend: FakeBackend, api_key: str
) -> None:
    with openai.OpenAI(base_url=pool_server.url + "/v1", api_key=api_key, max_retries=0) as client:
        conversation = client.conversations.create()
        client.responses.create(model="echo-1", input="first", conversation=conversation.id)
        backend.script(
            {"kind": "echo", "path": CHAT_PATH, "match": "hold the only connection", "delay_seconds": HOLD_SECONDS}
        )
        seen = len(backend.requests())
        worker, _ = _holding(lambda: client.responses.create(model="echo-1", input="hold the only connection"))
        _wait_for_requests(backend, seen + 1)

        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as refused:
            client.responses.create(model="echo-1", input="second", conversation=conversation.id)
        elapsed = time.monotonic() - started
        assert POOL_TIMEOUT * 0.8 <= elapsed < HOLD_SECONDS - 0.5
        assert refused.value.status_code == 503
        assert refused.value.response.headers.get("retry-after")
        error = refused.value.response.json()["error"]
        assert "in use" in error["message"] and "type" in error
        assert len(backend.requests()) == seen + 1
        worker.join()

        # Released: the conversation takes the same turn at once, and holds each turn once.
        client.responses.create(model="echo-1", input="second", conversation=conversation.id)
        items = client.conversations.items.list(conversation.id, order="asc")
        texts = [part.text for item in items.data for part in getattr(item, "content", []) if hasattr(part, "text")]
        assert texts.count("second") == 1
