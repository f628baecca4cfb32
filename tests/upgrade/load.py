"""The drill's steady mixed load: conversations of every kind (threads JSON and streamed, sessions, Responses chains
JSON and streamed, conversations), each driven by one worker turn after turn, each turn sent to the next live replica
in turn, so consecutive turns of one conversation alternate between the versions serving.

Every user turn carries a marker of its own. What a worker records is what was acknowledged: a JSON reply with status
200, or a stream that reached its end (`message_stop`, `response.completed`). A turn that failed is kept with the
replica and the time, for the drill to judge (only a replica's own stop may cut one); its conversation is not
continued (the failed turn may or may not be stored), and the worker begins another."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

API_KEY = "drill-key-0123456789"
THREADS_BETA = "message-threads-2026-08-12"
KINDS = ("thread", "thread_stream", "session", "chain", "chain_stream", "conversation")


@dataclass
class Turn:
    marker: str
    reply: str
    replica: str  # the URL that served it
    head: str  # what the next turn continues from (a message id, a response id, the conversation's id)


@dataclass
class Conversation:
    kind: str
    name: str
    turns: list[Turn] = field(default_factory=list)
    head: str | None = None  # thread: the last message id; chain: the last response id; conversation: its id
    thread_id: str | None = None  # threads and sessions: the thread the turns are stored under
    uncertain: str | None = None  # the marker of a failed last turn, which may or may not be stored


@dataclass
class Failure:
    kind: str
    replica: str
    at: float
    error: str


@dataclass
class Load:
    """Workers over `live()` (the replica URLs serving now, read before each turn)."""

    live: Callable[[], list[str]]
    workers: int = 6
    turns_per_conversation: int = 8
    pace: float = 0.0  # seconds a worker waits after each turn
    conversations: list[Conversation] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    acknowledged: int = 0
    _pick: itertools.count[int] = field(default_factory=itertools.count)

    def replica(self) -> str:
        urls = self.live()
        return urls[next(self._pick) % len(urls)]

    async def run(self, stop: asyncio.Event) -> None:
        limits = httpx.Limits(max_keepalive_connections=0)  # a stopped replica's kept connection is no fault of it
        async with httpx.AsyncClient(timeout=30, limits=limits) as http:
            await asyncio.gather(*(self._worker(http, stop, n) for n in range(self.workers)))

    async def _worker(self, http: httpx.AsyncClient, stop: asyncio.Event, number: int) -> None:
        for serial in itertools.count():
            if stop.is_set():
                return
            kind = KINDS[(number + serial) % len(KINDS)]
            conversation = Conversation(kind, f"w{number}-{serial}")
            self.conversations.append(conversation)
            for index in range(self.turns_per_conversation):
                if stop.is_set():
                    return
                if not await self.turn(http, conversation, f"[{conversation.name}-t{index}]"):
                    break
                if self.pace:
                    await asyncio.sleep(self.pace)

    async def turn(
        self, http: httpx.AsyncClient, conversation: Conversation, marker: str, url: str | None = None
    ) -> bool:
        """One turn of `conversation` on `url`, by default the next live replica; whether it was acknowledged."""
        url = url or self.replica()
        try:
            reply, head = await TURNS[conversation.kind](http, url, conversation, marker)
        except (httpx.HTTPError, TurnRefused) as exc:
            conversation.uncertain = marker
            self.failures.append(Failure(conversation.kind, url, time.monotonic(), f"{type(exc).__name__}: {exc}"))
            return False
        conversation.turns.append(Turn(marker, reply, url, head))
        conversation.head = head
        self.acknowledged += 1
        return True


class TurnRefused(Exception):
    pass


def _json(response: httpx.Response) -> Any:
    if response.status_code != 200:
        raise TurnRefused(f"{response.status_code} {response.text[:300]}")
    return response.json()


async def _events(response: httpx.Response) -> list[tuple[str, Any]]:
    if response.status_code != 200:
        await response.aread()
        raise TurnRefused(f"{response.status_code} {response.text[:300]}")
    events: list[tuple[str, Any]] = []
    name = ""
    async for line in response.aiter_lines():
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            events.append((name, orjson.loads(line[5:])))
    return events


MESSAGES_HEADERS = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01", "anthropic-beta": THREADS_BETA}
OPENAI_HEADERS = {"authorization": f"Bearer {API_KEY}"}


def _message_body(conversation: Conversation, marker: str, *, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "echo-1",
        "max_tokens": 200,
        "messages": [{"role": "user", "content": f"turn {marker}"}],
    }
    if conversation.kind != "session":
        body["thread"] = (
            {"type": "create"}
            if conversation.head is None
            else {"type": "continue", "previous_message_id": conversation.head}
        )
    if stream:
        body["stream"] = True
    return body


def _message_headers(conversation: Conversation) -> dict[str, str]:
    if conversation.kind == "session":
        return {**MESSAGES_HEADERS, "statestore-session-id": f"drill-{conversation.name}"}
    return MESSAGES_HEADERS


async def thread_turn(http: httpx.AsyncClient, url: str, conversation: Conversation, marker: str) -> tuple[str, str]:
    body = _message_body(conversation, marker, stream=False)
    response = await http.post(url + "/v1/messages", json=body, headers=_message_headers(conversation))
    message = _json(response)
    conversation.thread_id = response.headers["statestore-thread-id"]
    return message["content"][0]["text"], message["id"]


async def thread_stream_turn(
    http: httpx.AsyncClient, url: str, conversation: Conversation, marker: str
) -> tuple[str, str]:
    body = _message_body(conversation, marker, stream=True)
    async with http.stream("POST", url + "/v1/messages", json=body, headers=MESSAGES_HEADERS) as response:
        events = await _events(response)
        conversation.thread_id = response.headers["statestore-thread-id"]
    if not events or events[-1][0] != "message_stop":
        raise TurnRefused("the stream ended before message_stop")
    message_id = events[0][1]["message"]["id"]
    text = "".join(data["delta"].get("text", "") for name, data in events if name == "content_block_delta")
    return text, message_id


def _response_body(conversation: Conversation, marker: str, *, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "echo-1", "input": f"turn {marker}"}
    if conversation.kind == "conversation":
        body["conversation"] = conversation.head
    elif conversation.head is not None:
        body["previous_response_id"] = conversation.head
    if stream:
        body["stream"] = True
    return body


async def chain_turn(http: httpx.AsyncClient, url: str, conversation: Conversation, marker: str) -> tuple[str, str]:
    if conversation.kind == "conversation" and conversation.head is None:
        created = _json(await http.post(url + "/v1/conversations", json={}, headers=OPENAI_HEADERS))
        conversation.head = created["id"]
    body = _response_body(conversation, marker, stream=False)
    response = _json(await http.post(url + "/v1/responses", json=body, headers=OPENAI_HEADERS))
    if response["status"] != "completed":
        raise TurnRefused(f"status {response['status']}")
    text: str = response["output"][0]["content"][0]["text"]
    head = conversation.head if conversation.kind == "conversation" and conversation.head else response["id"]
    return text, str(head)


async def chain_stream_turn(
    http: httpx.AsyncClient, url: str, conversation: Conversation, marker: str
) -> tuple[str, str]:
    body = _response_body(conversation, marker, stream=True)
    async with http.stream("POST", url + "/v1/responses", json=body, headers=OPENAI_HEADERS) as response:
        events = await _events(response)
    if not events or events[-1][1].get("type") != "response.completed":
        raise TurnRefused("the stream ended before response.completed")
    final = events[-1][1]["response"]
    return final["output"][0]["content"][0]["text"], final["id"]


TURNS = {
    "thread": thread_turn,
    "thread_stream": thread_stream_turn,
    "session": thread_turn,
    "chain": chain_turn,
    "chain_stream": chain_stream_turn,
    "conversation": chain_turn,
}
