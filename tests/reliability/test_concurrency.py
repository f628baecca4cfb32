"""Invariant 2 across processes: two statestore servers on one PostgreSQL database and one Redis prefix; many clients
continue the same thread at the same moment, half through each server. Exactly one continue proceeds; every other
one is refused before anything reaches the backend with `thread_continue_in_flight` or `thread_already_continued`;
afterwards the thread's positions are contiguous and nothing is duplicated or lost.

The fake backend answers the winning continue after a delay, so the others arrive while it holds the head.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest

from tests.reliability.proof_support import (
    Database,
    assert_client_error,
    continue_body,
    create_body,
    new_key,
    servers_on,
    thread_headers,
    user,
)
from tests.support.fake_backend import FakeBackend
from tests.support.server import StatestoreServer

REFUSALS = {"thread_continue_in_flight", "thread_already_continued"}
BACKEND_DELAY_SECONDS = 0.6


@dataclass
class Pair:
    servers: tuple[StatestoreServer, StatestoreServer]
    db: Database
    backend: FakeBackend


@pytest.fixture(scope="module")
def pair(database: Database, redis_url: str, backend_process: FakeBackend) -> Iterator[Pair]:
    with servers_on(database, redis_url, backend_process) as servers:
        # Same database, same Redis prefix, two processes.
        yield Pair((servers.start(), servers.start()), database, backend_process)


@pytest.fixture
async def clients(pair: Pair) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    limits = httpx.Limits(max_connections=500, max_keepalive_connections=500)
    async with (
        httpx.AsyncClient(base_url=pair.servers[0].url, timeout=60, limits=limits) as first,
        httpx.AsyncClient(base_url=pair.servers[1].url, timeout=60, limits=limits) as second,
    ):
        yield first, second


async def _create(http: httpx.AsyncClient, key: str, text: str) -> tuple[str, str]:
    """(thread id, head response id) of a new thread."""
    response = await http.post(
        "/v1/messages", headers=thread_headers(key), content=orjson.dumps(create_body([user(text)]))
    )
    assert response.status_code == 200, response.text
    return response.headers["statestore-thread-id"], response.json()["id"]


async def _continue_at_once(
    clients: tuple[httpx.AsyncClient, httpx.AsyncClient], key: str, jobs: list[tuple[str, str]]
) -> list[httpx.Response]:
    """Send every (previous id, text) continue at the same moment, alternating between the two servers."""
    # Each request is built first; the last one built lets them all go.
    ready = asyncio.Barrier(len(jobs))

    async def one(index: int, previous_id: str, text: str) -> httpx.Response:
        http = clients[index % 2]
        request = http.build_request(
            "POST",
            "/v1/messages",
            headers=thread_headers(key),
            content=orjson.dumps(continue_body(previous_id, [user(text)])),
        )
        await ready.wait()
        return await http.send(request)

    return list(await asyncio.gather(*(one(i, previous, text) for i, (previous, text) in enumerate(jobs))))


def _refusal_code(response: httpx.Response) -> str:
    error = assert_client_error(response, 400)
    assert response.headers.get("x-should-retry") == "false"
    code: str = error.get("details", {}).get("error_code", "")
    return code


async def _check_whole(
    pair: Pair, http: httpx.AsyncClient, key: str, thread_id: str, expected: list[dict[str, Any]], head: str
) -> None:
    """The thread holds exactly `expected`, at positions 0..n-1, with `head` as its head and no lease left."""
    meta = await http.get(f"/statestore/v1/threads/{thread_id}", headers={"x-api-key": key})
    assert meta.status_code == 200, meta.text
    assert meta.json()["message_count"] == len(expected)
    assert meta.json()["turn_count"] == len(expected) // 2
    assert meta.json()["head_message_id"] == head
    exported = await http.get(f"/statestore/v1/threads/{thread_id}/messages", headers={"x-api-key": key})
    assert exported.status_code == 200, exported.text
    assert exported.json()["messages"] == expected
    [row] = (await pair.db.thread_rows([thread_id])).values()
    assert row["positions"] == list(range(len(expected)))
    assert row["head_position"] == len(expected)
    assert row["head_message_id"] == head
    assert row["lease_token"] is None
    # Only replies carry a response id, and the last one is the head.
    assert [rid is not None for rid in row["response_ids"]] == [i % 2 == 1 for i in range(len(expected))]
    assert row["response_ids"][-1] == head


def _echo(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": [{"type": "text", "text": f"echo: {text}"}]}


async def test_fifty_clients_on_two_servers_continue_one_thread_exactly_once(
    pair: Pair, clients: tuple[httpx.AsyncClient, httpx.AsyncClient]
) -> None:
    key = new_key()
    thread_id, head = await _create(clients[0], key, "start")
    pair.backend.reset()
    pair.backend.script({"kind": "echo", "delay_seconds": BACKEND_DELAY_SECONDS})

    responses = await _continue_at_once(clients, key, [(head, f"client {i}") for i in range(50)])

    winners = [(i, r) for i, r in enumerate(responses) if r.status_code == 200]
    assert len(winners) == 1, [(r.status_code, r.text[:200]) for r in responses if r.status_code != 200][:5]
    codes = Counter(_refusal_code(r) for r in responses if r.status_code != 200)
    assert sum(codes.values()) == 49
    assert set(codes) <= REFUSALS, codes
    # The winner held the head for the backend's delay: the others arrived meanwhile.
    assert codes["thread_continue_in_flight"] >= 1, codes
    [(index, winner)] = winners
    assert len(pair.backend.requests()) == 1, "a refused continue reached the backend"

    expected = [user("start"), _echo("start"), user(f"client {index}"), _echo(f"client {index}")]
    await _check_whole(pair, clients[1], key, thread_id, expected, winner.json()["id"])

    # The head moved on: the old id is spent, the new one continues (no lease was left behind), on either server.
    again = await clients[1].post(
        "/v1/messages", headers=thread_headers(key), content=orjson.dumps(continue_body(head, [user("late")]))
    )
    assert _refusal_code(again) == "thread_already_continued"
    following = await clients[0].post(
        "/v1/messages",
        headers=thread_headers(key),
        content=orjson.dumps(continue_body(winner.json()["id"], [user("next")])),
    )
    assert following.status_code == 200, following.text
    await _check_whole(
        pair, clients[1], key, thread_id, [*expected, user("next"), _echo("next")], following.json()["id"]
    )


async def test_a_hundred_threads_each_continued_by_three_clients_at_once(
    pair: Pair, clients: tuple[httpx.AsyncClient, httpx.AsyncClient]
) -> None:
    threads, racers = 100, 3
    key = new_key()
    created = await asyncio.gather(*(_create(clients[i % 2], key, f"start {i}") for i in range(threads)))
    heads = dict(created)
    pair.backend.reset()
    pair.backend.script(*({"kind": "echo", "delay_seconds": BACKEND_DELAY_SECONDS} for _ in range(threads)))

    jobs = [(head, f"t{t} r{r}") for r in range(racers) for t, (_, head) in enumerate(created)]
    responses = await _continue_at_once(clients, key, jobs)

    won: dict[str, list[tuple[str, httpx.Response]]] = {thread_id: [] for thread_id in heads}
    thread_of_head = {head: thread_id for thread_id, head in heads.items()}
    codes: Counter[str] = Counter()
    for (previous, text), response in zip(jobs, responses, strict=True):
        if response.status_code == 200:
            won[thread_of_head[previous]].append((text, response))
        else:
            codes[_refusal_code(response)] += 1
    assert {thread_id: len(winners) for thread_id, winners in won.items() if len(winners) != 1} == {}
    assert sum(codes.values()) == threads * (racers - 1)
    assert set(codes) <= REFUSALS, codes
    assert len(pair.backend.requests()) == threads, "a refused continue reached the backend"

    rows = await pair.db.thread_rows(list(heads))
    assert len(rows) == threads
    for index, (thread_id, _) in enumerate(created):
        [(text, winner)] = won[thread_id]
        expected = [user(f"start {index}"), _echo(f"start {index}"), user(text), _echo(text)]
        exported = await clients[index % 2].get(
            f"/statestore/v1/threads/{thread_id}/messages", headers={"x-api-key": key}
        )
        assert exported.json()["messages"] == expected, thread_id
        row = rows[thread_id]
        assert row["positions"] == [0, 1, 2, 3], (thread_id, row)
        assert row["head_message_id"] == winner.json()["id"]
        assert row["response_ids"][3] == winner.json()["id"]
        assert row["lease_token"] is None
    listing = await clients[0].get("/statestore/v1/threads", params={"limit": 1000}, headers={"x-api-key": key})
    assert {item["id"]: item["message_count"] for item in listing.json()["data"]} == dict.fromkeys(heads, 4)
