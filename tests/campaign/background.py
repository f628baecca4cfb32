"""Background responses in the campaign (docs/responses.md, "Background responses"): each client keeps chains of
responses and one conversation of its own on the Responses door, and now and then creates a background turn on one of
them (JSON, or `stream: true` read for a while and then cut), resumes a stream it cut (`GET
/v1/responses/{id}?stream=true& starting_after=N` on a replica picked at random, the balancer passed by), polls one,
cancels one or deletes one. Every event a client reads is recorded with its op, so the checker
(tests/campaign/background_check.py) can lay the original stream and its resumes end to end.

At the end, once the cluster has healed, each client reads every background response it was told the id of until it
has finished (or the grace runs out), reads the rest of each stream it had begun, and lists its conversation's
items."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from tests.campaign.history import History, Kind, Op
from tests.support.fake_backend import FakeBackend

MODEL = "echo-1"
OPEN = frozenset({"queued", "in_progress"})
FINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed", "response.cancelled"})
# How long a client reads one stream before it cuts the connection itself (a stream that outlives its client).
STREAM_SECONDS = 8.0
# Responses a client settles at once at the end.
SETTLE_AT_ONCE = 4
# Backend faults of background turns, each met by the one request carrying its marker: a stall (so that streams are
# cut and cancels land while the turn runs), and a few that end the turn failed.
STALL = {"kind": "echo", "path": "/v1/chat/completions", "stall_after_events": 2}
BROKEN: dict[str, dict[str, Any]] = {
    "error": {
        "kind": "error",
        "path": "/v1/chat/completions",
        "status": 500,
        "error": {"type": "server_error", "message": "campaign"},
    },
    "cut": {"kind": "echo", "path": "/v1/chat/completions", "cut_after_events": 3},
}


@dataclass
class Chain:
    """A chain of responses (`R<client>-<n>`, continued from its latest completed response) or the client's
    conversation (`C<client>`)."""

    key: str
    conversation_id: str | None = None
    head: str | None = None
    turns: int = 0

    @property
    def on_conversation(self) -> bool:
        return self.key.startswith("C")


@dataclass
class Tracked:
    """A background response the client was told the id of."""

    response_id: str
    chain: Chain
    last_seq: int = -1  # the last event of its stream the client read (original stream and resumes)
    streamed: bool = False  # the client read some of its stream
    stream_done: bool = False  # the client read its final event
    status: str | None = None  # the last status it was told
    deleted: bool = False


@dataclass
class BackgroundSettings:
    stall_rate: float = 0.5
    broken_rate: float = 0.04


class BackgroundClient:
    """One campaign client's background turns; `rng` is the client's own seeded generator."""

    def __init__(
        self,
        index: int,
        key: str,
        base_url: str,
        replica_urls: list[str],
        history: History,
        backend: FakeBackend,
        rng: random.Random,
        timeout: httpx.Timeout,
    ) -> None:
        self.index = index
        self.history = history
        self.backend = backend
        self.rng = rng
        self.replica_urls = replica_urls
        headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
        limits = httpx.Limits(max_connections=4, max_keepalive_connections=2)
        self.http = httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits, headers=headers)
        self.direct = httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers)
        self.chains: list[Chain] = []
        self.conversation = Chain(key=f"C{index}")
        self.tracked: dict[str, Tracked] = {}
        self._made = 0
        self.settings = BackgroundSettings()

    # -- the client's share of the workload -----------------------------------------------------------------------

    async def step(self) -> None:
        roll = self.rng.random()
        live = [t for t in self.tracked.values() if not t.deleted]
        unread = [t for t in live if not t.stream_done]
        running = [t for t in live if t.status is None or t.status in OPEN]
        if roll < 0.45 or not live:
            await self.create()
        elif roll < 0.65 and unread:
            await self.resume(self.rng.choice(unread[-8:]))
        elif roll < 0.82:
            await self.poll(self.rng.choice(live[-8:]))
        elif roll < 0.96:
            await self.cancel(self.rng.choice(running[-4:] or live[-4:]))
        else:
            finished = [t for t in live if t.status is not None and t.status not in OPEN]
            if finished:
                await self.delete(self.rng.choice(finished))

    def _chain(self) -> Chain:
        if self.rng.random() < 0.3:
            return self.conversation
        self.chains = [chain for chain in self.chains if chain.turns < 8]
        if len(self.chains) < 2:
            chain = Chain(key=f"R{self.index}-{self._made}")
            self._made += 1
            self.chains.append(chain)
            return chain
        return self.rng.choice(self.chains)

    async def create(self) -> None:
        chain = self._chain()
        if chain.on_conversation and chain.conversation_id is None:
            await self.open_conversation(chain)
            if chain.conversation_id is None:
                return
        stream = self.rng.random() < 0.5
        op = self.history.begin(self.index, "bg-stream" if stream else "bg-create", chain.key, stream=stream)
        body: dict[str, Any] = {"model": MODEL, "input": op.text(), "background": True, "max_output_tokens": 64}
        body |= await self._backend_fault(op)
        if chain.conversation_id is not None:
            body["conversation"] = chain.conversation_id
        elif chain.head is not None:
            body["previous_response_id"] = op.previous_id = chain.head
        chain.turns += 1
        body["stream"] = stream
        if not stream:
            try:
                reply = await self.http.post("/v1/responses", content=orjson.dumps(body))
            except httpx.TransportError:
                self.history.finish(op, "unknown", error="transport")
                return
            if reply.status_code != 200:
                self._refused(op, chain, reply)
                return
            told = reply.json()
            self.history.finish(op, "ok", status=200, response_id=told["id"], response_status=told["status"])
            tracked = self._track(op, chain)
            if self.rng.random() < 0.25:
                await self.cancel(tracked)  # while it is queued or running, most likely
            return
        cut_after = self.rng.randint(1, 8) if self.rng.random() < 0.6 else None
        await self._read_stream(op, self.http.stream("POST", "/v1/responses", content=orjson.dumps(body)), cut_after)
        if op.response_id is None:
            if op.status not in (None, 200):
                chain.head = None if op.error == "previous_response_not_found" else chain.head
            return
        tracked = self._track(op, chain)
        if tracked.stream_done:
            return
        roll = self.rng.random()
        if roll < 0.6:
            await self.resume(tracked)  # the client reconnects at once, on whichever replica
        elif roll < 0.75:
            await self.cancel(tracked)

    def _refused(self, op: Op, chain: Chain, reply: httpx.Response) -> None:
        code = _error_code(reply)
        self.history.finish(op, "fail" if reply.status_code < 500 else "unknown", status=reply.status_code, error=code)
        if code == "previous_response_not_found":
            chain.head = None  # deleted meanwhile: the chain starts again

    def _track(self, op: Op, chain: Chain) -> Tracked:
        assert op.response_id is not None
        tracked = self.tracked.setdefault(op.response_id, Tracked(op.response_id, chain))
        self._observed(tracked, op)
        return tracked

    def _observed(self, tracked: Tracked, op: Op) -> None:
        if op.events:
            tracked.streamed = True
            tracked.last_seq = op.events[-1][0]
            tracked.stream_done = tracked.stream_done or op.events[-1][1] in FINAL_EVENTS
        if op.response_status is not None:
            tracked.status = op.response_status
            if op.response_status in ("completed", "incomplete") and not tracked.chain.on_conversation:
                tracked.chain.head = tracked.response_id

    async def _backend_fault(self, op: Op) -> dict[str, Any]:
        """Maybe arrange a backend fault for this turn: the marker rides in `instructions`, which are the request's
        own (never carried over to a later turn of the chain)."""
        marker = f"~{op.id}~"
        roll = self.rng.random()
        action: dict[str, Any] | None = None
        if roll < self.settings.broken_rate:
            op.backend_fault = self.rng.choice(sorted(BROKEN))
            action = BROKEN[op.backend_fault]
        elif roll < self.settings.broken_rate + self.settings.stall_rate:
            op.backend_fault = "stall"
            action = {**STALL, "stall_seconds": round(self.rng.uniform(0.3, 2.0), 2)}
        if action is not None:
            await asyncio.to_thread(self.backend.script, {**action, "match": marker})
        return {"instructions": marker}

    async def open_conversation(self, chain: Chain) -> None:
        op = self.history.begin(self.index, "bg-conversation", chain.key)
        try:
            reply = await self.http.post("/v1/conversations", content=b"{}")
        except httpx.TransportError:
            self.history.finish(op, "unknown", error="transport")
            return
        if reply.status_code != 200:
            self.history.finish(op, _outcome(reply.status_code), status=reply.status_code)
            return
        chain.conversation_id = reply.json()["id"]
        self.history.finish(op, "ok", status=200, thread_id=chain.conversation_id)

    async def replay(self, tracked: Tracked) -> Op:
        """The whole stream again, from its first event (which leaves what the client had read as it was)."""
        return await self._follow(tracked, "bg-replay", -1, cut=False)

    async def resume(self, tracked: Tracked, *, kind: Kind = "bg-resume", cut: bool = True) -> Op:
        """Read the stream on from the last event read, on a replica picked at random."""
        op = await self._follow(tracked, kind, tracked.last_seq, cut=cut)
        self._observed(tracked, op)
        return op

    async def _follow(self, tracked: Tracked, kind: Kind, after: int, *, cut: bool) -> Op:
        url = self.rng.choice(self.replica_urls)
        op = self.history.begin(
            self.index, kind, tracked.chain.key, response_id=tracked.response_id, after=after, stream=True
        )
        params = {"stream": "true", "starting_after": str(after)}
        cut_after = self.rng.randint(1, 6) if cut and self.rng.random() < 0.2 else None
        request = self.direct.stream("GET", f"{url}/v1/responses/{tracked.response_id}", params=params)
        await self._read_stream(op, request, cut_after)
        return op

    async def _read_stream(self, op: Op, request: Any, cut_after: int | None) -> None:
        """Read a stream's events into `op` until its final event, the client's cut (after `cut_after` events, or
        STREAM_SECONDS) or a broken connection. The op is `ok` once the response's id is known."""
        op.events = []
        cut = None
        try:
            async with asyncio.timeout(STREAM_SECONDS), request as reply:
                op.status = reply.status_code
                if reply.status_code != 200:
                    raw = await reply.aread()
                    op.error = _error_code_of(raw)
                    self.history.finish(op, "fail" if reply.status_code < 500 else "unknown")
                    return
                async for line in reply.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    self._record_event(op, orjson.loads(line[6:]))
                    if op.events[-1][1] in FINAL_EVENTS:
                        break
                    if cut_after is not None and len(op.events) >= cut_after:
                        cut = "cut"
                        break
        except TimeoutError:
            cut = "timeout"
        except (httpx.TransportError, httpx.StreamError):
            cut = "transport"
        finished = bool(op.events) and op.events[-1][1] in FINAL_EVENTS
        self.history.finish(op, "ok" if op.response_id else "unknown", error=None if finished else cut)

    def _record_event(self, op: Op, event: dict[str, Any]) -> None:
        kind = str(event.get("type"))
        text = ""
        if kind == "response.output_text.delta":
            text = str(event.get("delta", ""))
        response = event.get("response")
        if isinstance(response, dict):
            op.response_id = op.response_id or response.get("id")
            if kind in FINAL_EVENTS:
                op.response_status = response.get("status")
                op.output_text = output_text(response)
                op.response_error = _response_error(response)
        assert op.events is not None
        op.events.append((int(event.get("sequence_number", -1)), kind, text))

    async def poll(self, tracked: Tracked, *, kind: Kind = "bg-poll") -> Op:
        op = self.history.begin(self.index, kind, tracked.chain.key, response_id=tracked.response_id)
        try:
            reply = await self.http.get(f"/v1/responses/{tracked.response_id}")
        except httpx.TransportError:
            return self.history.finish(op, "unknown", error="transport")
        return self._told(op, tracked, reply)

    async def cancel(self, tracked: Tracked) -> Op:
        op = self.history.begin(self.index, "bg-cancel", tracked.chain.key, response_id=tracked.response_id)
        try:
            reply = await self.http.post(f"/v1/responses/{tracked.response_id}/cancel")
        except httpx.TransportError:
            return self.history.finish(op, "unknown", error="transport")
        return self._told(op, tracked, reply)

    def _told(self, op: Op, tracked: Tracked, reply: httpx.Response) -> Op:
        if reply.status_code != 200:
            return self.history.finish(op, _outcome(reply.status_code), status=reply.status_code)
        try:
            told = reply.json()
        except ValueError:
            return self.history.finish(op, "unknown", status=200, error="torn-json")
        self.history.finish(
            op,
            "ok",
            status=200,
            response_status=told.get("status"),
            output_text=output_text(told),
            response_error=_response_error(told),
        )
        self._observed(tracked, op)
        return op

    async def delete(self, tracked: Tracked) -> None:
        op = self.history.begin(self.index, "bg-delete", tracked.chain.key, response_id=tracked.response_id)
        tracked.deleted = True  # whatever the outcome: the checker counts a delete of unknown outcome as done
        if tracked.chain.head == tracked.response_id:
            tracked.chain.head = None
        try:
            reply = await self.http.delete(f"/v1/responses/{tracked.response_id}")
        except httpx.TransportError:
            self.history.finish(op, "unknown", error="transport")
            return
        self.history.finish(op, _outcome(reply.status_code), status=reply.status_code)

    # -- the end: every response settled, every stream read to its end ---------------------------------------------

    async def settle(self, grace: float) -> None:
        """Once the cluster has healed: each response the client was told of, read until it has finished or the grace
        (a few lease periods, from now) runs out (`bg-final`); the rest of each stream it had begun; the items of its
        conversation (`bg-items`)."""
        deadline = time.monotonic() + grace
        slots = asyncio.Semaphore(SETTLE_AT_ONCE)

        async def settle_one(tracked: Tracked, replay: bool) -> None:
            async with slots:
                while True:
                    op = await self.poll(tracked, kind="bg-final")
                    if op.outcome == "fail" or (op.outcome == "ok" and op.response_status not in OPEN):
                        break
                    if time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.25)
                if op.outcome != "ok":
                    return
                if tracked.streamed and not tracked.stream_done:
                    for _ in range(3):  # a cut connection while the replicas settle is read again
                        if (await self.resume(tracked, kind="bg-tail", cut=False)).error is None:
                            break
                if tracked.streamed or replay:
                    await self.replay(tracked)

        # Whether to read a JSON-created response's stream again is drawn here, in order, so a seed replays it.
        chosen = [(tracked, self.rng.random() < 0.3) for tracked in self.tracked.values() if not tracked.deleted]
        await asyncio.gather(*(settle_one(tracked, replay) for tracked, replay in chosen))
        if self.conversation.conversation_id is not None:
            await self.conversation_items(self.conversation)

    async def conversation_items(self, chain: Chain) -> None:
        op = self.history.begin(self.index, "bg-items", chain.key, thread_id=chain.conversation_id)
        texts: list[str] = []
        params: dict[str, str] = {"order": "asc", "limit": "100"}
        try:
            while True:
                reply = await self.http.get(f"/v1/conversations/{chain.conversation_id}/items", params=params)
                if reply.status_code != 200:
                    self.history.finish(op, _outcome(reply.status_code), status=reply.status_code)
                    return
                page = reply.json()
                for item in page["data"]:
                    if item.get("type") == "message" and item.get("role") == "user":
                        texts += [part.get("text", "") for part in item.get("content") or []]
                if not page.get("has_more"):
                    break
                params["after"] = page["last_id"]
        except httpx.TransportError:
            self.history.finish(op, "unknown", error="transport")
            return
        self.history.finish(op, "ok", status=200, read=texts)

    async def close(self) -> None:
        await self.http.aclose()
        await self.direct.aclose()


def output_text(response: dict[str, Any]) -> str:
    """The text of a Response's output messages, as the SDK's `output_text` joins it."""
    parts = []
    for item in response.get("output") or []:
        if isinstance(item, dict) and item.get("type") == "message":
            for part in item.get("content") or []:
                if isinstance(part, dict) and part.get("type") == "output_text":
                    parts.append(str(part.get("text", "")))
    return "".join(parts)


def _response_error(response: dict[str, Any]) -> str | None:
    error = response.get("error")
    return str(error.get("code")) if isinstance(error, dict) else None


def _outcome(status: int) -> Any:
    return "ok" if status == 200 else "fail" if status < 500 else "unknown"


def _error_code(reply: httpx.Response) -> str | None:
    return _error_code_of(reply.content)


def _error_code_of(raw: bytes) -> str | None:
    try:
        error = orjson.loads(raw).get("error") or {}
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return str(error.get("code") or error.get("type") or "") or None
