"""The campaign's clients: each owns an owner (its own credential), a handful of threads and two sessions, and runs
random operations against the balancer until told to stop, recording each in the history.

A client keeps what it was acknowledged: each thread's head id (the reply id it may continue from) and the ids the
thread has moved past (for continues from stale ids). After an operation whose outcome it cannot know, it reads the
thread's head from the thread API before continuing that thread again."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from tests.campaign.background import BackgroundClient
from tests.campaign.history import History, Kind, Op, Outcome
from tests.campaign.keyed import KeyedClient
from tests.reliability.proof_support import ADMIN, MODEL, THREADS_BETA
from tests.reliability.support import sse_data
from tests.support.fake_backend import FakeBackend

OP_TIMEOUT = httpx.Timeout(15.0, connect=3.0)
TURNS_PER_THREAD = 16
# A backend fault an operation meets on purpose (consumed by the request carrying its marker). The first three end
# the backend's reply early, so such a turn must never be stored; the others only slow it down.
BACKEND_FAULTS: dict[str, dict[str, Any]] = {
    "error": {"kind": "error", "status": 529, "error": {"type": "overloaded_error", "message": "campaign"}},
    "close": {"kind": "close"},
    "cut": {"kind": "echo", "cut_after_events": 3, "cut_after_bytes": 40},
    "stall": {"kind": "echo", "stall_after_events": 2, "stall_seconds": 1.0},
    "delay": {"kind": "echo", "delay_seconds": 0.8},
}
NEVER_STORED = frozenset({"error", "close", "cut"})
# The share of a client's steps that are background responses' (tests/campaign/background.py), and keyed writes'
# (tests/campaign/keyed.py).
BACKGROUND_SHARE = 0.05
KEYED_SHARE = 0.08


def user_texts(messages: list[dict[str, Any]]) -> list[str]:
    """The op ids of the user turns of a conversation (each user text is "<thread key> <op id>")."""
    found = []
    for message in messages:
        content = message.get("content")
        if message.get("role") == "user" and isinstance(content, str) and " " in content:
            found.append(content.split(" ", 1)[1])
    return found


@dataclass
class ThreadState:
    key: str
    user_id: str
    thread_id: str | None = None
    head: str | None = None
    stale_ids: list[str] = field(default_factory=list)
    turns: int = 0
    needs_resync: bool = False
    gone: bool = False


@dataclass
class ClientSettings:
    backend_fault_rate: float = 0.04
    live_threads: int = 6


class Client:
    def __init__(
        self,
        index: int,
        base_url: str,
        history: History,
        backend: FakeBackend,
        seed: int,
        replica_urls: list[str] | None = None,
    ) -> None:
        self.index = index
        self.key = f"sk-campaign-{seed}-{index}"
        self.history = history
        self.backend = backend
        self.rng = random.Random(seed * 1000 + index)
        self.http = httpx.AsyncClient(
            base_url=base_url,
            timeout=OP_TIMEOUT,
            limits=httpx.Limits(max_connections=6, max_keepalive_connections=2),
            headers={
                "x-api-key": self.key,
                "anthropic-version": "2023-06-01",
                "anthropic-beta": THREADS_BETA,
                "content-type": "application/json",
            },
        )
        self.threads: list[ThreadState] = []
        self.all_threads: list[ThreadState] = []
        self.sessions = [f"S{index}-{n}" for n in range(2)]
        self._made = 0
        self.settings = ClientSettings()
        self.background = BackgroundClient(
            index, self.key, base_url, replica_urls or [base_url], history, backend, self.rng, OP_TIMEOUT
        )
        self.keyed = KeyedClient(index, self.key, base_url, replica_urls or [base_url], history, self.rng, OP_TIMEOUT)

    # -- one operation ------------------------------------------------------------------------------------------

    def _new_thread(self) -> ThreadState:
        key = f"T{self.index}-{self._made}"
        self._made += 1
        state = ThreadState(key=key, user_id=f"campaign-{key}")
        self.all_threads.append(state)
        return state

    async def _backend_fault(self, op: Op) -> dict[str, Any]:
        """Maybe arrange a backend fault for this turn; the extra request fields that carry its marker."""
        marker = f"~{op.id}~"
        if self.rng.random() < self.settings.backend_fault_rate:
            name = self.rng.choice(sorted(BACKEND_FAULTS))
            op.backend_fault = name
            await asyncio.to_thread(self.backend.script, {**BACKEND_FAULTS[name], "match": marker})
        # A per-turn field, never stored: only this turn's request carries the marker.
        return {"stop_sequences": [marker]}

    async def turn(
        self,
        kind: Kind,
        thread: ThreadState,
        *,
        previous_id: str | None,
        session: str | None = None,
        stream: bool = False,
    ) -> Op:
        op = self.history.begin(self.index, kind, thread.key, previous_id=previous_id, stream=stream)
        body: dict[str, Any] = {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": op.text()}]}
        body |= await self._backend_fault(op)
        headers = {}
        if session is not None:
            headers["statestore-session-id"] = session
        elif previous_id is None:
            body["thread"] = {"type": "create"}
            body["metadata"] = {"user_id": thread.user_id}
        else:
            body["thread"] = {"type": "continue", "previous_message_id": previous_id}
        if stream:
            body["stream"] = True
        try:
            async with self.http.stream("POST", "/v1/messages", content=orjson.dumps(body), headers=headers) as reply:
                op.thread_id = reply.headers.get("statestore-thread-id")
                raw = await reply.aread()
        except (httpx.TransportError, httpx.StreamError):
            return self.history.finish(op, "unknown", error="transport")
        return self._turn_outcome(op, reply, raw, stream)

    def _turn_outcome(self, op: Op, reply: httpx.Response, raw: bytes, stream: bool) -> Op:
        if reply.status_code != 200:
            code = _error_code(raw)
            relayed = b'"campaign"' in raw
            # statestore's own 5xx may come after a commit whose outcome it lost: unknown. A relayed backend error
            # and every 4xx are definite.
            # statestore says "not stored" only once it has fenced the commit and found no row.
            definite = relayed or reply.status_code < 500 or b"the turn was not stored" in raw
            return self.history.finish(op, "fail" if definite else "unknown", status=reply.status_code, error=code)
        if not stream:
            try:
                message_id = orjson.loads(raw)["id"]
            except (orjson.JSONDecodeError, KeyError, TypeError):
                return self.history.finish(op, "unknown", status=200, error="torn-json")
            return self.history.finish(op, "ok", status=200, message_id=message_id)
        events = sse_data(raw)
        started = [e["message"]["id"] for e in events if e.get("type") == "message_start"]
        if any(e.get("type") == "error" for e in events):
            return self.history.finish(op, "fail", status=200, error="stream-error")
        if not any(e.get("type") == "message_stop" for e in events):
            # The id was seen, so a later continue may name it; whether it was stored is unknown.
            return self.history.finish(op, "unknown", status=200, error="cut", message_id=(started or [None])[0])
        return self.history.finish(op, "ok", status=200, message_id=started[0])

    async def read(self, thread: ThreadState) -> Op:
        op = self.history.begin(self.index, "read", thread.key, thread_id=thread.thread_id)
        try:
            reply = await self.http.get(f"/statestore/v1/threads/{thread.thread_id}/messages")
        except httpx.TransportError:
            return self.history.finish(op, "unknown", error="transport")
        if reply.status_code != 200:
            return self.history.finish(op, "fail" if reply.status_code < 500 else "unknown", status=reply.status_code)
        return self.history.finish(op, "ok", status=200, read=user_texts(reply.json()["messages"]))

    async def head(self, thread: ThreadState) -> Op:
        op = self.history.begin(self.index, "head", thread.key, thread_id=thread.thread_id)
        try:
            reply = await self.http.get(f"/statestore/v1/threads/{thread.thread_id}")
        except httpx.TransportError:
            return self.history.finish(op, "unknown", error="transport")
        if reply.status_code != 200:
            return self.history.finish(op, "fail" if reply.status_code < 500 else "unknown", status=reply.status_code)
        return self.history.finish(op, "ok", status=200, message_id=reply.json()["head_message_id"])

    async def delete(self, thread: ThreadState) -> Op:
        op = self.history.begin(self.index, "delete", thread.key, thread_id=thread.thread_id)
        try:
            reply = await self.http.delete(f"/statestore/v1/threads/{thread.thread_id}")
        except httpx.TransportError:
            return self.history.finish(op, "unknown", error="transport")
        return self.history.finish(op, _outcome(reply.status_code), status=reply.status_code)

    async def erase(self, thread: ThreadState) -> Op:
        op = self.history.begin(self.index, "erase", thread.key, thread_id=thread.thread_id)
        try:
            reply = await self.http.post("/admin/v1/erase", json={"user_id": thread.user_id}, headers=ADMIN)
            if reply.status_code == 202:
                # Started: it is done (nothing of it readable) only once its erasure says so.
                reply = await self._erasure_done(reply.json()["id"])
        except httpx.TransportError:
            return self.history.finish(op, "unknown", error="transport")
        return self.history.finish(op, _outcome(reply.status_code), status=reply.status_code)

    async def _erasure_done(self, erasure_id: str) -> httpx.Response:
        """The erasure polled until it is no longer running: 200 once done; its last reply otherwise (a failed one as
        a 500, and one still running after a minute, its replica killed meanwhile, as a 504: both unknown)."""
        deadline = asyncio.get_running_loop().time() + 60
        while asyncio.get_running_loop().time() < deadline:
            reply = await self.http.get(f"/admin/v1/erasures/{erasure_id}", headers=ADMIN)
            if reply.status_code != 200:
                return reply
            status = reply.json()["status"]
            if status == "done":
                return reply
            if status == "failed":
                return httpx.Response(500, request=reply.request)
            await asyncio.sleep(0.2)
        return httpx.Response(504, request=reply.request)

    # -- the client's loop --------------------------------------------------------------------------------------

    def _after_turn(self, thread: ThreadState, op: Op) -> None:
        if op.thread_id and thread.thread_id is None:
            thread.thread_id = op.thread_id
        if op.outcome == "ok":
            if thread.head is not None:
                thread.stale_ids.append(thread.head)
            thread.head = op.message_id
            thread.turns += 1
            thread.needs_resync = False
        elif op.outcome == "unknown" or op.error == "thread_already_continued":
            thread.needs_resync = True

    async def _resync(self, thread: ThreadState) -> None:
        if thread.thread_id is None:
            thread.gone = True  # a create that never told its id: left for the final listing to find
            return
        op = await self.head(thread)
        if op.outcome == "ok":
            if op.message_id != thread.head and thread.head is not None:
                thread.stale_ids.append(thread.head)
            thread.head = op.message_id
            thread.needs_resync = False
        elif op.status == 404:
            thread.gone = True

    async def step(self) -> None:
        roll = self.rng.random()
        if roll < BACKGROUND_SHARE:
            await self.background.step()
            return
        if roll < BACKGROUND_SHARE + KEYED_SHARE:
            await self.keyed.step()
            return
        self.threads = [t for t in self.threads if not t.gone and t.turns < TURNS_PER_THREAD]
        while len(self.threads) < self.settings.live_threads:
            thread = self._new_thread()
            self.threads.append(thread)
            op = await self.turn("create", thread, previous_id=None, stream=self.rng.random() < 0.3)
            self._after_turn(thread, op)
            if op.outcome != "ok":
                thread.needs_resync = True
            return
        thread = self.rng.choice(self.threads)
        if thread.needs_resync:
            await self._resync(thread)
            return
        roll = self.rng.random()
        if roll < 0.45:
            op = await self.turn("continue", thread, previous_id=thread.head, stream=self.rng.random() < 0.4)
            self._after_turn(thread, op)
        elif roll < 0.55 and thread.stale_ids:
            await self.turn("stale", thread, previous_id=self.rng.choice(thread.stale_ids))
        elif roll < 0.62:
            ops = await asyncio.gather(
                *(self.turn("race", thread, previous_id=thread.head, stream=n == 0) for n in range(3))
            )
            for op in ops:
                if op.outcome == "ok":
                    self._after_turn(thread, op)
            if not any(op.outcome == "ok" for op in ops):
                thread.needs_resync = True
        elif roll < 0.77:
            await self.session_turn()
        elif roll < 0.93:
            await (self.read(thread) if roll < 0.87 else self.head(thread))
        elif roll < 0.965:
            op = await self.delete(thread)
            thread.gone = op.outcome == "ok" or op.status == 404
        else:
            op = await self.erase(thread)
            thread.gone = op.outcome == "ok"

    async def session_turn(self) -> None:
        name = self.rng.choice(self.sessions)
        state = next((t for t in self.all_threads if t.key == name), None)
        if state is None:
            state = ThreadState(key=name, user_id=f"campaign-{name}")
            self.all_threads.append(state)
        op = await self.turn("session", state, previous_id=None, session=name, stream=self.rng.random() < 0.3)
        if op.thread_id and state.thread_id is None:
            state.thread_id = op.thread_id

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.step()

    def stopping(self) -> None:
        """The workload stops: a keyed write still retried gives up now (it is sent again once healed)."""
        self.keyed.stop.set()

    async def close(self) -> None:
        await self.http.aclose()
        await self.background.close()
        await self.keyed.close()


def _outcome(status: int) -> Outcome:
    return "ok" if status == 200 else "fail" if status < 500 else "unknown"


def _error_code(raw: bytes) -> str | None:
    try:
        error = orjson.loads(raw).get("error") or {}
    except (orjson.JSONDecodeError, AttributeError):
        return None
    code = (error.get("details") or {}).get("error_code")
    return str(code) if code else str(error.get("type") or "") or None
