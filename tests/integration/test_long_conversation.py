"""A 1,000-turn conversation through the SDK's thread helper (docs/protocol.md §2, docs/guarantees.md invariant 3).

The client sends only each new turn; the backend must receive exactly the request a stateless client would have sent
with the whole history: earlier turns' block `cache_control` markers dropped, the new turn's kept, laid out as
statestore lays out a rebuilt body (this turn's fields in the client's order, then `system`, `tools`, `messages`).

The conversation is a deterministic mix of plain text turns (string and block content, some with a marker), tool_use
replies answered with tool_result turns (nested content, errors, a marker on a block or deep inside one), and replies
with signed thinking and redacted thinking blocks. Texts carry non-ASCII, quotes, backslashes and control characters so
the JSON escaping is exercised too.

Run twice on PostgreSQL + Redis: with the Redis copy warm throughout, and with this server's Redis keys deleted at
turn 500, so that turn is rebuilt from PostgreSQL. Both runs must forward the same bytes.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import anthropic
import httpx
import httpx2
import orjson
import pytest
import redis
from anthropic.lib.threads._thread_state import as_sent, without_cache_control
from anthropic.types.beta import BetaMessageParam, BetaTextBlockParam, BetaToolParam

from tests.support.fake_backend import FakeBackend, RecordedRequest, message_action
from tests.support.server import StatestoreServer

TURNS = 1000
BATCH = 100  # scripted replies queued (and recorded requests fetched, then forgotten) per batch
FLUSH_AT = 500  # the turn sent right after this server's Redis keys are deleted
CHECKED_TURNS = (0, 1, 2, 3, 4, 5, 99, 100, 137, 499, 500, 501, 777, TURNS - 2, TURNS - 1)

MODEL = "claude-test-long"
MAX_TOKENS = 2048
EPHEMERAL: dict[str, Any] = {"type": "ephemeral"}
SYSTEM: list[BetaTextBlockParam] = [
    {"type": "text", "text": "You are a meticulous travel assistant. Answer briefly."},
    {
        "type": "text",
        "text": "Policy: use the tools for facts; never guess a fare.",
        "cache_control": {"type": "ephemeral"},
    },
]
TOOLS: list[BetaToolParam] = [
    {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
    {
        "name": "search_fares",
        "description": "Fares between two airports.",
        "input_schema": {
            "type": "object",
            "properties": {"from": {"type": "string"}, "to": {"type": "string"}, "cache_control": {"type": "object"}},
            "required": ["from", "to"],
        },
        "cache_control": {"type": "ephemeral"},
    },
]
FIXED_MARKERS = 2  # one on system, one on tools: a turn may add one more (docs/protocol.md §2: at most 3)

PHRASES = (
    "What's the weather in Paris?",
    'He said "book it" \\ then left.',
    "naïve café — Zürich → 東京 🚀",
    "line one\nline two\ttabbed",
    "control \u0001 and \u2028 separators",
    "</script><b>not html</b>",
    "",
    "plain words only",
)


def _text(rng: random.Random, turn: int, what: str) -> str:
    return f"{what} {turn}: {rng.choice(PHRASES)} #{rng.randrange(10**6)}"


@dataclass
class Turn:
    """One turn of the conversation: what the client sends and what the backend is scripted to answer."""

    messages: list[dict[str, Any]]
    reply: list[dict[str, Any]]
    stop_reason: str
    markers: int


def _reply_blocks(rng: random.Random, turn: int, *, tool_calls: int) -> list[dict[str, Any]]:
    """A reply as a backend sends it (`type` first): signed thinking, sometimes redacted thinking, text, tool calls."""
    blocks: list[dict[str, Any]] = []
    if turn % 3 != 2:
        blocks.append(
            {"type": "thinking", "thinking": _text(rng, turn, "thinking"), "signature": f"EqQBCkYIARgCKkD{turn:06d}=="}
        )
    if turn % 7 == 3:
        blocks.append({"type": "redacted_thinking", "data": f"EmwKAhgBEgy{turn:08x}"})
    blocks.append({"type": "text", "text": _text(rng, turn, "answer")})
    for call in range(tool_calls):
        name, tool_input = (
            ("get_weather", {"city": rng.choice(["Paris", "Kyōto", "São Paulo"])})
            if call % 2 == 0
            # A "cache_control" key in a tool's input is free-form data and must be kept (not a block marker).
            else ("search_fares", {"from": "CDG", "to": "NRT", "cache_control": {"type": "ephemeral", "n": turn}})
        )
        blocks.append({"type": "tool_use", "id": f"toolu_{turn:04d}_{call}", "name": name, "input": tool_input})
    return blocks


def conversation(seed: int = 20261102) -> Iterator[Turn]:
    """Deterministic turns in a cycle of five: text -> (marked text, tool call) -> tool result -> (text, two parallel
    tool calls) -> two tool results (one marked, one an error) -> text ..."""
    rng = random.Random(seed)
    pending_calls: list[dict[str, Any]] = []
    for turn in range(TURNS):
        kind = turn % 5
        markers = 0
        if kind == 0:
            content: Any = _text(rng, turn, "question")
        elif kind == 1:
            content = [
                {"type": "text", "text": _text(rng, turn, "context")},
                {"type": "text", "text": _text(rng, turn, "question"), "cache_control": dict(EPHEMERAL)},
            ]
            markers = 1
        elif kind == 3:
            content = [{"type": "text", "text": _text(rng, turn, "follow-up")}]
        else:
            content = []
            for index, call in enumerate(pending_calls):
                result: dict[str, Any] = {"type": "tool_result", "tool_use_id": call["id"]}
                if kind == 4 and index == 1:
                    result |= {"content": "fare service unavailable", "is_error": True}
                else:
                    nested: dict[str, Any] = {"type": "text", "text": _text(rng, turn, "result")}
                    if kind == 4 and turn % 10 == 4:
                        nested["cache_control"] = dict(EPHEMERAL)  # a marker deep inside a tool_result
                        markers += 1
                    result["content"] = [nested]
                    if kind == 4 and turn % 10 == 9:
                        result["cache_control"] = dict(EPHEMERAL)  # a marker on the tool_result block itself
                        markers += 1
                content.append(result)
        tool_calls = {1: 1, 3: 2}.get(kind, 0)
        reply = _reply_blocks(rng, turn, tool_calls=tool_calls)
        pending_calls = [block for block in reply if block["type"] == "tool_use"]
        assert FIXED_MARKERS + markers <= 3
        yield Turn([{"role": "user", "content": content}], reply, "tool_use" if tool_calls else "end_turn", markers)


@dataclass
class Wire:
    """What the SDK put on the wire for each `POST /v1/messages`, and the raw reply bodies it got back."""

    sent: list[bytes] = field(default_factory=list)
    received: list[bytes] = field(default_factory=list)
    thread_ids: set[str] = field(default_factory=set)

    def on_request(self, request: httpx2.Request) -> None:
        if request.method == "POST" and request.url.path == "/v1/messages":
            self.sent.append(request.read())

    def on_response(self, response: httpx2.Response) -> None:
        if response.request.method == "POST" and response.request.url.path == "/v1/messages":
            self.received.append(response.read())
            thread_id = response.headers.get("statestore-thread-id")
            if thread_id is not None:
                self.thread_ids.add(thread_id)


def _load(raw: bytes) -> dict[str, Any]:
    value = orjson.loads(raw)
    assert isinstance(value, dict)
    return value


def expected_body(sent: Sequence[dict[str, Any]], received: Sequence[dict[str, Any]], turn: int) -> bytes:
    """The request a stateless client sends for `turn`, built from scratch: the whole history, with the earlier turns'
    block markers dropped (the SDK's own `without_cache_control`) and the replies as they were returned, laid out as
    statestore lays a rebuilt body out."""
    request = sent[turn]
    history: list[Any] = []
    for earlier in range(turn):
        history += cast(list[Any], without_cache_control(sent[earlier]["messages"]))
        history.append({"role": "assistant", "content": received[earlier]["content"]})
    fields = {key: value for key, value in request.items() if key not in ("thread", "system", "tools", "messages")}
    body = {**fields, "system": sent[0]["system"], "tools": sent[0]["tools"], "messages": history + request["messages"]}
    return orjson.dumps(body)


def _split(body: bytes) -> tuple[bytes, bytes]:
    """(everything before the messages array, the array's inner bytes). `messages` is the last field."""
    marker = b',"messages":['
    at = body.index(marker)
    assert body.endswith(b"]}")
    return body[:at], body[at + len(marker) : -2]


@dataclass
class Growth:
    """Checks, request after request, that each one only grew by the new turn."""

    previous: bytes | None = None
    previous_turn: list[bytes] = field(default_factory=list)  # the previous turn's messages as stored, and its reply
    previous_history: bytes = b""  # the previous request's messages before its new turn
    previous_marked: bool = False  # whether the previous turn's messages carried block markers

    def check(self, turn: int, body: bytes, sent: dict[str, Any], received: dict[str, Any]) -> None:
        """Request `turn` is request `turn - 1` with the new turn appended: the same fields, system and tools, the same
        history, then the previous turn (its block markers dropped) and its reply as returned, then this turn's messages
        as the client sent them. When the previous turn had no marker, its request's messages bytes are a prefix."""
        head, messages = _split(body)
        new = [orjson.dumps(message) for message in sent["messages"]]
        if self.previous is None:
            assert messages == b",".join(new), f"turn {turn}: a create forwards the client's messages"
        else:
            previous_head, previous_messages = _split(self.previous)
            assert head == previous_head, f"turn {turn}: fields, system or tools changed"
            assert messages.startswith(self.previous_history), f"turn {turn}: the earlier history changed"
            if not self.previous_marked:
                assert messages.startswith(previous_messages), f"turn {turn}: request {turn - 1} is not a prefix"
            assert messages == b",".join([self.previous_history, *self.previous_turn, *new]).lstrip(b","), (
                f"turn {turn}: the request grew by more than the new turn"
            )
        reply = orjson.dumps({"role": "assistant", "content": received["content"]})
        stripped = [orjson.dumps(without_cache_control(orjson.loads(message))) for message in new]
        self.previous = body
        self.previous_history = messages[: len(messages) - len(b",".join(new))].rstrip(b",")
        self.previous_turn = [*stripped, reply]
        self.previous_marked = stripped != new


def _metric(server: StatestoreServer, name: str, labels: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=5).text
    match = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.MULTILINE)
    assert match is not None, f"no {name}{{{labels}}} in /metrics"
    return float(match.group(1))


def _cache_lookups(server: StatestoreServer) -> dict[str, float]:
    return {r: _metric(server, "cache_lookups_total", f'result="{r}"') for r in ("hit", "miss", "stale", "error")}


def _delete_prefix(redis_url: str, prefix: str) -> list[bytes]:
    """Delete every key under this server's prefix (SCAN + DEL, never FLUSHALL: the Redis is shared)."""
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=prefix + "*", count=1000))
        if keys:
            client.delete(*keys)
        return keys
    finally:
        client.close()


FINAL_BODIES: dict[bool, bytes] = {}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("flush_redis", [False, True], ids=["redis-warm", "redis-flushed-at-500"])
def test_thousand_turns_forward_the_full_history_byte_for_byte(
    pg_server: StatestoreServer,
    backend: FakeBackend,
    api_key: str,
    redis_url: str,
    server_redis_prefix: str,
    flush_redis: bool,
) -> None:
    turns = list(conversation())
    wire = Wire()
    lookups_before = _cache_lookups(pg_server)
    http_client = httpx2.Client(
        timeout=30.0, event_hooks={"request": [wire.on_request], "response": [wire.on_response]}
    )
    checked: dict[int, bytes] = {}
    growth = Growth()
    flushed: list[bytes] = []
    started = time.monotonic()
    send_seconds = 0.0
    with anthropic.Anthropic(base_url=pg_server.url, api_key=api_key, max_retries=0, http_client=http_client) as client:
        thread = client.beta.messages.thread(
            model=MODEL,
            max_tokens=MAX_TOKENS,
            system=SYSTEM,
            tools=TOOLS,
            thinking={"type": "enabled", "budget_tokens": 1024},
            metadata={"user_id": "long-conversation-user"},
            stop_sequences=["\n\nHuman:"],
        )
        for batch_start in range(0, TURNS, BATCH):
            batch = turns[batch_start : batch_start + BATCH]
            backend.reset()
            backend.script(*(message_action(t.reply, stop_reason=t.stop_reason) for t in batch))
            batch_sent = time.monotonic()
            for offset, turn in enumerate(batch):
                index = batch_start + offset
                if flush_redis and index == FLUSH_AT:
                    flushed = _delete_prefix(redis_url, server_redis_prefix)
                reply = thread.send(*cast(list[BetaMessageParam], turn.messages))
                assert reply.stop_reason == turn.stop_reason
            send_seconds += time.monotonic() - batch_sent
            requests = backend.requests()
            assert len(requests) == len(batch), "one backend request per turn"
            for offset, recorded in enumerate(requests):
                index = batch_start + offset
                growth.check(index, recorded.body, _load(wire.sent[index]), _load(wire.received[index]))
                if index in CHECKED_TURNS:
                    checked[index] = recorded.body
            last_request: RecordedRequest = requests[-1]
        assert backend.pending() == 0
        sdk_history = list(thread.messages)
    elapsed = time.monotonic() - started

    sent = [_load(raw) for raw in wire.sent]
    received = [_load(raw) for raw in wire.received]
    assert len(sent) == len(received) == TURNS, "the SDK never had to replay or retry"
    assert len(wire.thread_ids) == 1, "one thread for the whole conversation"
    assert sent[0]["thread"] == {"type": "create"}
    assert all(body["thread"]["type"] == "continue" for body in sent[1:])
    assert all("system" not in body and "tools" not in body for body in sent[1:])
    assert [body["messages"] for body in sent] == [turn.messages for turn in turns], "the client sent only new turns"
    assert [body["content"] for body in received] == [turn.reply for turn in turns]

    # The last request, and a few along the way, are byte for byte the full-history request.
    assert last_request.body == expected_body(sent, received, TURNS - 1)
    for index, body in sorted(checked.items()):
        assert body == expected_body(sent, received, index), f"turn {index}"

    # The same conversation seen through the SDK: its history, sent again the way the SDK replays a thread
    # (`as_sent`, then `without_cache_control` up to the last reply), is the conversation statestore forwarded.
    last = _load(last_request.body)
    assert len(sdk_history) == 2 * TURNS
    replayed = [*cast(list[Any], without_cache_control(as_sent(sdk_history[:-2]))), as_sent(sdk_history[-2])]
    assert last["messages"] == replayed
    assert last["system"] == SYSTEM
    assert last["tools"] == TOOLS
    # Free-form tool input keeps its "cache_control" key; only block markers go.
    assert b'"input":{"from":"CDG","to":"NRT","cache_control":{"type":"ephemeral","n":3}}' in last_request.body
    assert last_request.body.count(b'"cache_control":{"type":"ephemeral"}') == FIXED_MARKERS + turns[-1].markers

    lookups = {key: value - lookups_before[key] for key, value in _cache_lookups(pg_server).items()}
    (thread_id,) = wire.thread_ids
    if flush_redis:
        assert any(thread_id.encode() in key for key in flushed), "this thread's Redis keys were deleted"
        assert lookups == {"hit": TURNS - 2, "miss": 1, "stale": 0, "error": 0}, lookups
    else:
        assert lookups == {"hit": TURNS - 1, "miss": 0, "stale": 0, "error": 0}, lookups
    # The Redis copy holds the whole thread again (refilled after the rebuild from PostgreSQL).
    cache = redis.Redis.from_url(redis_url)
    try:
        assert cache.get(f"{server_redis_prefix}{{{thread_id}}}:n") == b"2:%d" % (2 * TURNS)
    finally:
        cache.close()

    # Warm or rebuilt from PostgreSQL, the forwarded bytes are the same.
    FINAL_BODIES[flush_redis] = last_request.body
    if len(FINAL_BODIES) == 2:
        assert FINAL_BODIES[True] == FINAL_BODIES[False]
    print(
        f"\n{TURNS} turns ({'flushed at ' + str(FLUSH_AT) if flush_redis else 'warm'}): {elapsed:.1f}s in all, "
        f"{send_seconds:.1f}s sending, last request {len(last_request.body)} bytes"
    )
