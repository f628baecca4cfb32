"""Keyed writes in the campaign (docs/responses.md, "Retries that never store twice"): each client keeps a
conversation and chains of responses of its own on the Responses door, and writes to them with an `Idempotency-Key`,
as a client behind a load balancer that must not store twice would: on any error or timeout it sends the same request
again with the same key, to whichever replica (the balancer or one of the replicas, at random), until it is answered
or gives up. Some answered writes are sent once more with their key (a client that lost the first answer), whose
answer must be the first's.

Writes: a Response on the keyed conversation (JSON or streamed), items appended to it, a Response continuing a keyed
chain, and on the Messages door a turn creating or continuing a keyed thread (JSON or streamed), which the thread
checks of tests/campaign/checker.py hold as any turn. Each keyed Response names its op in `metadata.user_id`
(`keyed:<op id>`), which is stored in clear, so that the checker counts its copies in the database
(tests/campaign/keyed_check.py) and the commit nemesis can aim at its commit (tests/campaign/nemesis.py). At the end
each client lists its conversation's items."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from tests.campaign.cluster import read_after_heal
from tests.campaign.history import History, Op
from tests.reliability.proof_support import MODEL as MESSAGES_MODEL
from tests.reliability.proof_support import THREADS_BETA
from tests.reliability.support import sse_data

MODEL = "echo-1"
# In every keyed Response's metadata.user_id, which is stored in clear: what the commit nemesis's lost commits match.
MARKER = b"keyed:"
# How long a client retries one write under its key before it gives up (its outcome then unknown): longer than a
# claim outlives a killed replica (the campaign's lease, 4 s) and than a replica takes to start again.
RETRY_FOR = 30.0
# The share of answered writes sent once more under their key.
AGAIN = 0.3
# 4xx answers a client retries besides 409 and 429: its key still held by a request that is running or was cut off,
# the conversation still leased by one.
RETRIED_CODES = frozenset({"conversation_locked", "idempotency_key_in_flight"})


@dataclass
class Chain:
    key: str
    head: str | None = None
    turns: int = 0


@dataclass
class Answer:
    status: int
    code: str | None
    told: str | None  # what a 2xx told: the ids it stored and their text; None when it told nothing complete
    replayed: bool


class KeyedClient:
    """One campaign client's keyed writes; `rng` is the client's own seeded generator."""

    def __init__(
        self,
        index: int,
        key: str,
        base_url: str,
        replica_urls: list[str],
        history: History,
        rng: random.Random,
        timeout: httpx.Timeout,
    ) -> None:
        self.index = index
        self.history = history
        self.rng = rng
        self.base_url = base_url
        self.targets = [base_url, *replica_urls]
        headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
        limits = httpx.Limits(max_connections=4, max_keepalive_connections=2)
        self.http = httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers)
        self.conversation = Chain(key=f"K{index}")
        self.conversation_id: str | None = None
        self.chains: list[Chain] = []
        self.threads: list[Chain] = []
        self._made = 0
        self.api_key = key
        # Set when the workload stops: a write still unanswered then is given up and sent again under its key once
        # the cluster has healed (`settle`).
        self.stop = asyncio.Event()
        self.unanswered: list[tuple[Op, str, bytes]] = []

    async def step(self) -> None:
        if self.conversation_id is None:
            await self.open_conversation()
            return
        roll = self.rng.random()
        if roll < 0.3:
            await self.respond()
        elif roll < 0.5:
            await self.append()
        elif roll < 0.7:
            await self.continue_chain()
        else:
            await self.thread_turn()

    async def open_conversation(self) -> None:
        op = self.history.begin(self.index, "key-conversation", self.conversation.key)
        try:
            reply = await self.http.post(f"{self.base_url}/v1/conversations", content=b"{}")
        except httpx.TransportError:
            self.history.finish(op, "unknown", error="transport")
            return
        if reply.status_code != 200:
            self.history.finish(op, "fail" if reply.status_code < 500 else "unknown", status=reply.status_code)
            return
        self.conversation_id = reply.json()["id"]
        self.history.finish(op, "ok", status=200, thread_id=self.conversation_id)

    async def respond(self) -> None:
        op = self.history.begin(self.index, "key-respond", self.conversation.key, thread_id=self.conversation_id)
        stream = self.rng.random() < 0.3
        body = {"model": MODEL, "input": op.text(), "conversation": self.conversation_id, "stream": stream}
        await self._write(op, "/v1/responses", body | {"metadata": {"user_id": f"keyed:{op.id}"}}, stream=stream)

    async def append(self) -> None:
        op = self.history.begin(self.index, "key-append", self.conversation.key, thread_id=self.conversation_id)
        items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": op.text()}]
        if self.rng.random() < 0.5:
            items.append({"type": "message", "role": "assistant", "content": f"noted {op.id}"})
        await self._write(op, f"/v1/conversations/{self.conversation_id}/items", {"items": items}, stream=False)

    async def continue_chain(self) -> None:
        self.chains = [chain for chain in self.chains if chain.turns < 8]
        if len(self.chains) < 2:
            chain = Chain(key=f"KR{self.index}-{self._made}")
            self._made += 1
            self.chains.append(chain)
        else:
            chain = self.rng.choice(self.chains)
        op = self.history.begin(self.index, "key-chain", chain.key, previous_id=chain.head)
        body: dict[str, Any] = {"model": MODEL, "input": op.text(), "metadata": {"user_id": f"keyed:{op.id}"}}
        if chain.head is not None:
            body["previous_response_id"] = chain.head
        chain.turns += 1
        await self._write(op, "/v1/responses", body, stream=False)
        if op.outcome == "ok":
            chain.head = op.response_id
        elif op.error == "previous_response_not_found":
            chain.head = None

    async def thread_turn(self) -> None:
        """A turn on the Messages door creating or continuing a keyed thread (`KT<client>-<n>`). A thread whose turn
        went unanswered is left (the final listing finds it; the heal continues it)."""
        self.threads = [thread for thread in self.threads if thread.turns < 8]
        if len(self.threads) < 2:
            thread = Chain(key=f"KT{self.index}-{self._made}")
            self._made += 1
            self.threads.append(thread)
        else:
            thread = self.rng.choice(self.threads)
        op = self.history.begin(self.index, "key-message", thread.key, previous_id=thread.head)
        body: dict[str, Any] = {
            "model": MESSAGES_MODEL,
            "max_tokens": 64,
            "messages": [{"role": "user", "content": op.text()}],
        }
        if thread.head is None:
            body["thread"] = {"type": "create"}
        else:
            body["thread"] = {"type": "continue", "previous_message_id": thread.head}
        thread.turns += 1
        stream = self.rng.random() < 0.3
        await self._write(op, "/v1/messages", body | ({"stream": True} if stream else {}), stream=stream)
        if op.outcome == "ok":
            thread.head = op.message_id
        else:
            self.threads.remove(thread)

    # -- one write, under its key, until answered -----------------------------------------------------------------

    async def _write(self, op: Op, path: str, body: dict[str, Any], *, stream: bool) -> None:
        op.key = f"kc-{op.id}-{self.rng.getrandbits(48):012x}"
        op.stream = stream
        op.answers = []
        content = orjson.dumps(body)
        if not await self._until_answered(op, path, content, self.base_url, time.monotonic() + RETRY_FOR):
            if op.outcome == "unknown" and op.kind != "key-message":
                # (A thread's turn is not sent again once healed: the heal continues its thread.)
                self.unanswered.append((op, path, content))
            return
        if self.rng.random() < AGAIN:
            # The same request once more, to another replica perhaps: answered as the first, stored nothing again.
            again = await self._attempt(op, self.rng.choice(self.targets) + path, content)
            if again is not None and again.told is not None:
                op.answers.append((again.told, again.replayed))

    async def _until_answered(
        self, op: Op, path: str, content: bytes, target: str, deadline: float, *, settling: bool = False
    ) -> bool:
        """Send the write under its key until it is answered (ok), refused (fail), the deadline passes or (unless
        `settling`) the workload stops (unknown); whether it was answered."""
        assert op.answers is not None
        while True:
            answer = await self._attempt(op, target + path, content)
            if answer is not None and answer.told is not None:
                op.answers.append((answer.told, answer.replayed))
                first = _first_id(op.answers[0][0])
                if op.kind == "key-message":
                    self.history.finish(op, "ok", status=200, error=None, message_id=first)
                else:
                    self.history.finish(op, "ok", status=200, error=None, response_id=first)
                return True
            if answer is not None and _refused(answer):
                self.history.finish(op, "fail", status=answer.status, error=answer.code)
                return False
            if time.monotonic() > deadline or (self.stop.is_set() and not settling):
                last = f"gave-up after {answer.code or answer.status}" if answer else "gave-up after transport"
                self.history.finish(op, "unknown", status=answer.status if answer else None, error=last)
                return False
            await asyncio.sleep(self.rng.uniform(0.2, 1.0))
            target = self.rng.choice(self.targets)

    async def settle(self, within: float) -> None:
        """Once the cluster has healed: each write left unanswered when the workload stopped, sent again under its
        key (to whichever replica) until answered, within `within` seconds."""
        deadline = time.monotonic() + within
        for op, path, content in self.unanswered:
            await self._until_answered(op, path, content, self.rng.choice(self.targets), deadline, settling=True)

    async def _attempt(self, op: Op, url: str, content: bytes) -> Answer | None:
        op.attempts += 1
        headers = {"idempotency-key": op.key or ""}
        if op.kind == "key-message":
            headers |= {"x-api-key": self.api_key, "anthropic-version": "2023-06-01", "anthropic-beta": THREADS_BETA}
        try:
            async with self.http.stream("POST", url, content=content, headers=headers) as reply:
                raw = await reply.aread()
        except (httpx.TransportError, httpx.StreamError):
            return None
        replayed = reply.headers.get("idempotent-replayed") == "true"
        if op.kind == "key-message":
            op.thread_id = op.thread_id or reply.headers.get("statestore-thread-id")
            if 200 <= reply.status_code < 300:
                return Answer(reply.status_code, None, _message_told(raw, streamed=op.stream), replayed)
        if not 200 <= reply.status_code < 300:
            return Answer(reply.status_code, _error_code(raw), None, replayed)
        return Answer(reply.status_code, None, _told(raw, streamed=op.stream), replayed)

    async def conversation_items(self) -> None:
        """The keyed conversation's items at the end: each user item's text, in order (`read`), and every item's
        id (`answers`, one entry per item)."""
        if self.conversation_id is None:
            return
        op = self.history.begin(self.index, "key-items", self.conversation.key, thread_id=self.conversation_id)
        texts: list[str] = []
        ids: list[tuple[str, bool]] = []
        params: dict[str, str] = {"order": "asc", "limit": "100"}
        url = f"{self.base_url}/v1/conversations/{self.conversation_id}/items"
        try:
            while True:
                reply = await read_after_heal(self.http, url, params)
                if reply.status_code != 200:
                    self.history.finish(op, "fail" if reply.status_code < 500 else "unknown", status=reply.status_code)
                    return
                page = reply.json()
                for item in page["data"]:
                    ids.append((str(item.get("id")), False))
                    if item.get("type") == "message" and item.get("role") == "user":
                        texts.append(_text(item))
                if not page.get("has_more"):
                    break
                params["after"] = page["last_id"]
        except httpx.TransportError:
            self.history.finish(op, "unknown", error="transport")
            return
        self.history.finish(op, "ok", status=200, read=texts, answers=ids)

    async def close(self) -> None:
        await self.http.aclose()


def _told(raw: bytes, *, streamed: bool) -> str | None:
    """What an answer told, as one string to compare a retry's answer with: the Response's id, its output items'
    ids and its text (a stream: its final event's, once it completed), or the appended items' ids and texts."""
    if streamed:
        events = sse_data(raw)
        final = [e for e in events if e.get("type") == "response.completed"]
        if not final:
            return None
        body: Any = final[-1]["response"]
    else:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None
    if not isinstance(body, dict):
        return None
    if body.get("object") == "list":
        return " | ".join(f"{item.get('id')} {_text(item)}" for item in body.get("data") or [])
    if body.get("status") != "completed":
        return None
    output = body.get("output") or []
    return " | ".join([str(body.get("id")), *(f"{item.get('id')} {_text(item)}" for item in output)])


def _message_told(raw: bytes, *, streamed: bool) -> str | None:
    """What a Messages answer told: the reply's message id and its text (a stream: once it ended)."""
    if streamed:
        events = sse_data(raw)
        started = [e["message"]["id"] for e in events if e.get("type") == "message_start"]
        if not started or not any(e.get("type") == "message_stop" for e in events):
            return None
        deltas = (e.get("delta") or {} for e in events if e.get("type") == "content_block_delta")
        return f"{started[0]} {''.join(str(delta.get('text', '')) for delta in deltas)}"
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(body, dict) or "id" not in body:
        return None
    return f"{body['id']} {''.join(str(part.get('text', '')) for part in body.get('content') or [])}"


def _refused(answer: Answer) -> bool:
    """A definite refusal: a 4xx that stored nothing, other than the few a client waits out."""
    return 400 <= answer.status < 500 and answer.status not in (409, 429) and answer.code not in RETRIED_CODES


def _first_id(told: str) -> str:
    return told.split(" ", 1)[0]


def _text(item: dict[str, Any]) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    return "".join(str(part.get("text", "")) for part in content or [] if isinstance(part, dict))


def _error_code(raw: bytes) -> str | None:
    try:
        error = orjson.loads(raw).get("error") or {}
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return str(error.get("code") or error.get("type") or "") or None
