"""Regression guard for the hot path (docs/architecture.md, "Performance principles"): a continue never parses or
re-serialises the stored history. Every JSON decode and encode inside statestore is counted by size during a continue of
a long thread; what is parsed must be the new turn and the reply, whatever the history's size. And while the app serves,
what its startup built is left out of the garbage collector's walks."""

from __future__ import annotations

import gc
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import orjson
import pytest

from statestore.api.front_door import FrontDoor
from statestore.app import create_server_app
from statestore.config import Settings
from statestore.store.migrate import upgrade
from tests.support.fake_backend import BackendProcess

THREADS_BETA = "message-threads-2026-08-12"
HEADERS = {"content-type": "application/json", "x-api-key": "k-hot-path", "anthropic-beta": THREADS_BETA}


class Counter:
    def __init__(self) -> None:
        self.decoded: list[int] = []
        self.encoded: list[int] = []


@pytest.fixture(scope="module")
def echo_backend() -> Iterator[BackendProcess]:
    with BackendProcess("--echo") as backend:
        yield backend


def _server_app(tmp_path: Any, echo_backend: BackendProcess) -> FrontDoor:
    url = f"sqlite+aiosqlite:///{tmp_path / 'hot.db'}"
    upgrade(url)
    # The app `statestore serve` runs: the front door before FastAPI.
    front = create_server_app(
        Settings(database_url=url, upstream_url=echo_backend.url, owner_secret="hot-path-secret-0123456789")
    )
    assert isinstance(front, FrontDoor)
    return front


@pytest.fixture
async def app_client(tmp_path: Any, echo_backend: BackendProcess) -> AsyncIterator[httpx.AsyncClient]:
    front = _server_app(tmp_path, echo_backend)
    async with (
        front.app.router.lifespan_context(front.app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=front), base_url="http://statestore") as client,
    ):
        yield client


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Counter:
    counter = Counter()
    real_loads, real_dumps, real_json_loads = orjson.loads, orjson.dumps, json.loads

    def loads(data: Any) -> Any:
        counter.decoded.append(len(data))
        return real_loads(data)

    def dumps(value: Any, *args: Any, **kwargs: Any) -> bytes:
        out = real_dumps(value, *args, **kwargs)
        counter.encoded.append(len(out))
        return out

    def json_loads(data: Any, *args: Any, **kwargs: Any) -> Any:
        counter.decoded.append(len(data))
        return real_json_loads(data, *args, **kwargs)

    monkeypatch.setattr(orjson, "loads", loads)
    monkeypatch.setattr(orjson, "dumps", dumps)
    monkeypatch.setattr(json, "loads", json_loads)
    return counter


def _turn(text: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": text}]}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_continue_parses_only_the_new_turn_and_the_reply(
    app_client: httpx.AsyncClient, counted: Counter, stream: bool
) -> None:
    # A long history: 400 messages of ~2 KB each (~800 KB), created in one request.
    history: list[dict[str, Any]] = []
    for i in range(200):
        history.append(_turn(f"question {i} " + "x" * 2000))
        history.append({"role": "assistant", "content": [{"type": "text", "text": f"answer {i} " + "y" * 2000}]})
    history.append(_turn("the last question"))
    created = await app_client.post(
        "/v1/messages",
        headers=HEADERS,
        content=orjson.dumps({"model": "m", "max_tokens": 50, "messages": history, "thread": {"type": "create"}}),
    )
    assert created.status_code == 200, created.text
    history_bytes = sum(len(orjson.dumps(m)) for m in history)
    assert history_bytes > 800_000

    counted.decoded.clear()
    counted.encoded.clear()
    body = orjson.dumps(
        {
            "model": "m",
            "max_tokens": 50,
            "stream": stream,
            "messages": [_turn("a new question")],
            "thread": {"type": "continue", "previous_message_id": created.json()["id"]},
        }
    )
    continued = await app_client.post("/v1/messages", headers=HEADERS, content=body)
    assert continued.status_code == 200, continued.text
    if stream:
        assert b"event: message_stop" in continued.content

    # What was parsed and written is the turn and the reply: a few KB, nowhere near the 800 KB history.
    assert sum(counted.decoded) < 20_000, counted.decoded
    assert max(counted.encoded) < 20_000, counted.encoded
    assert len(body) in counted.decoded  # the request itself was parsed once


async def test_what_startup_built_is_left_out_of_full_collections_while_the_app_serves(
    tmp_path: Any, echo_backend: BackendProcess
) -> None:
    # A full collection of a started server walked ~160k objects (85 ms, every request paused); frozen, they are not
    # walked. Given back when the app stops, so a process that starts it again collects them as before.
    front = _server_app(tmp_path, echo_backend)
    assert gc.get_freeze_count() == 0
    async with front.app.router.lifespan_context(front.app):
        assert gc.get_freeze_count() > 50_000
        started = gc.get_freeze_count()
        gc.collect()
        assert gc.get_freeze_count() == started  # a collection leaves them frozen
    assert gc.get_freeze_count() == 0
