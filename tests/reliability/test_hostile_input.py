"""A catalogue of malformed and abusive requests against a real statestore on PostgreSQL and Redis (docs/guarantees.md:
"bad input gets a clear 4xx in the error shape of the API it came through, never a 5xx"; invariant 4: nothing is
stored without a valid opt-in).

Every case must get a 4xx (never a 5xx) in the shape of docs/protocol.md §4 with a `request-id` header, and leave no
trace: the row counts of every table stay the same (a half-made thread row counts too), the caller's
`GET /statestore/v1/threads` is unchanged, another owner's thread is untouched, and, unless the case says otherwise,
the backend received nothing.

The server here has small policy limits (6 messages, 8 KiB a thread) and a 64 KiB body limit, so the limits can be
crossed cheaply.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from tests.reliability.proof_support import (
    ADMIN,
    ADMIN_TOKEN,
    MODEL,
    THREADS_BETA,
    Database,
    assert_client_error,
    check_error_shape,
    continue_body,
    create_body,
    new_key,
    servers_on,
    thread_headers,
    user,
)
from tests.support.admin_api import erased_counts
from tests.support.fake_backend import FakeBackend
from tests.support.server import StatestoreServer

MAX_BODY_BYTES = 65_536
MAX_MESSAGES = 6
MAX_THREAD_BYTES = 8_192
TENANT = "acme-reliability"

Headers = dict[str, str] | list[tuple[bytes, bytes]]


@dataclass(frozen=True)
class Ctx:
    """What a case may refer to: its own owner, another owner's live thread, and (when asked) a thread of its own."""

    key: str
    victim_thread: str
    victim_head: str
    own_head: str = ""


@dataclass(frozen=True)
class Req:
    method: str
    path: str
    headers: Headers = field(default_factory=dict)
    body: bytes | None = None
    chunked: bool = False
    # Bytes sent as they are on a fresh connection, for what no HTTP client would send.
    raw: bytes | None = None


@dataclass(frozen=True)
class Case:
    id: str
    build: Callable[[Ctx], Req]
    status: int | None = None
    # False where handing the request to the backend is the designed behaviour (its 4xx is then relayed).
    backend_silent: bool = True
    statestore_made: bool = True
    own_thread: bool = False


# == request builders ================================================================================================


def _json(value: Any) -> bytes:
    # The standard library, not orjson: it writes nesting deeper than orjson's 254 levels.
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def turn(ctx: Ctx, body: bytes | Any, *, headers: Headers | None = None, beta: bool = True) -> Req:
    """POST /v1/messages as a threaded client sends it; `headers` replace the defaults when given as a list."""
    content = body if isinstance(body, bytes) else _json(body)
    if isinstance(headers, list):
        return Req("POST", "/v1/messages", headers, content)
    base = thread_headers(ctx.key)
    if not beta:
        del base["anthropic-beta"]
    return Req("POST", "/v1/messages", {**base, **(headers or {})}, content)


def create(ctx: Ctx, **fields: Any) -> Req:
    return turn(ctx, create_body([user("hello")], **fields))


def with_thread(ctx: Ctx, thread: Any) -> Req:
    return turn(ctx, {"model": MODEL, "max_tokens": 64, "thread": thread, "messages": [user("hello")]})


def with_messages(ctx: Ctx, messages: Any) -> Req:
    return turn(ctx, {"model": MODEL, "max_tokens": 64, "thread": {"type": "create"}, "messages": messages})


def with_message(ctx: Ctx, message: Any) -> Req:
    return with_messages(ctx, [message])


def continuing(ctx: Ctx, previous_id: Any) -> Req:
    thread = {"type": "continue", "previous_message_id": previous_id}
    return turn(ctx, {"model": MODEL, "max_tokens": 64, "thread": thread, "messages": [user("again")]})


def session_turn(ctx: Ctx, name: bytes, **extra: bytes) -> Req:
    headers = [(k.encode(), v.encode()) for k, v in thread_headers(ctx.key).items() if k != "anthropic-beta"]
    headers.append((b"statestore-session-id", name))
    headers.extend((k.replace("_", "-").encode(), v) for k, v in extra.items())
    body = {"model": MODEL, "max_tokens": 64, "messages": [user("hello")]}
    return Req("POST", "/v1/messages", headers, _json(body))


def ttl(ctx: Ctx, value: bytes) -> Req:
    headers = [(k.encode(), v.encode()) for k, v in thread_headers(ctx.key).items()]
    headers.append((b"statestore-ttl", value))
    return Req("POST", "/v1/messages", headers, _json(create_body([user("hello")])))


def get(ctx: Ctx, path: str, *, auth: bool = True) -> Req:
    return Req("GET", path, {"x-api-key": ctx.key} if auth else {})


def owner(ctx: Ctx, method: str, path: str, body: bytes | None = None) -> Req:
    return Req(method, path, {"x-api-key": ctx.key, "content-type": "application/json"}, body)


def admin(method: str, path: str, body: Any = None, *, raw: bytes | None = None, headers: Headers | None = None) -> Req:
    content = raw if raw is not None else (None if body is None else _json(body))
    return Req(method, path, headers if headers is not None else {**ADMIN, "content-type": "application/json"}, content)


_DROP: Any = object()


def policy(**changes: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "threads_enabled": True,
        "sessions_enabled": True,
        "default_ttl_seconds": 300,
        "max_ttl_seconds": 3600,
        "max_thread_bytes": 1_000_000,
        "max_messages": 1000,
    }
    values.update(changes)
    return {k: v for k, v in values.items() if v is not _DROP}


def raw_turn(ctx: Ctx, extra_header_lines: bytes, *, content_length: bytes | None = None) -> Req:
    body = _json(create_body([user("hello")]))
    head = (
        b"POST /v1/messages HTTP/1.1\r\nhost: statestore\r\nconnection: close\r\n"
        b"content-type: application/json\r\nx-api-key: " + ctx.key.encode() + b"\r\n"
        b"anthropic-beta: " + THREADS_BETA.encode() + b"\r\n" + extra_header_lines
    )
    length = content_length if content_length is not None else str(len(body)).encode()
    return Req("POST", "/v1/messages", raw=head + b"content-length: " + length + b"\r\n\r\n" + body)


def nested(depth: int, leaf: Any = "x") -> Any:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


GOOD = _json(create_body([user("hello")]))
FORGED_ID = "msg_" + "A1b2C3d4E5f6G7h8I9j0Kl" + "m1N2o3P4q5R6s7T8u9V0wx"


# == the catalogue ===================================================================================================

CASES: list[Case] = [
    # -- bad JSON ----------------------------------------------------------------------------------------------------
    Case("json-truncated", lambda c: turn(c, GOOD[:-7]), 400),
    Case("json-trailing-garbage", lambda c: turn(c, GOOD + b" }{"), 400),
    Case("json-nan", lambda c: turn(c, GOOD.replace(b'"max_tokens":64', b'"max_tokens":NaN')), 400),
    Case("json-infinity", lambda c: turn(c, GOOD.replace(b'"max_tokens":64', b'"max_tokens":Infinity')), 400),
    Case("json-number-overflow", lambda c: turn(c, GOOD.replace(b'"max_tokens":64', b'"max_tokens":1e999')), 400),
    Case("json-bom", lambda c: turn(c, b"\xef\xbb\xbf" + GOOD), 400),
    Case("json-invalid-utf8", lambda c: turn(c, GOOD.replace(b'"hello"', b'"hel\xfflo"')), 400),
    Case("json-lone-surrogate-escape", lambda c: turn(c, GOOD.replace(b'"hello"', b'"hel\\ud800lo"')), 400),
    Case("json-surrogate-bytes", lambda c: turn(c, GOOD.replace(b'"hello"', b'"hel\xed\xa0\x80lo"')), 400),
    Case("json-single-quotes", lambda c: turn(c, GOOD.replace(b'"', b"'")), 400),
    Case("json-comment", lambda c: turn(c, GOOD[:-1] + b"/* note */}"), 400),
    Case("json-empty-body", lambda c: turn(c, b""), 400),
    Case("json-null", lambda c: turn(c, b"null"), 400),
    Case("json-array", lambda c: turn(c, b"[" + GOOD + b"]"), 400),
    Case("json-string", lambda c: turn(c, b'"thread"'), 400),
    # orjson keeps the last of duplicate keys; the last `thread` here is not a valid one.
    Case("json-duplicate-keys", lambda c: turn(c, GOOD[:-1] + b',"thread":"create"}'), 400),
    Case("json-nesting-10000", lambda c: turn(c, GOOD[:-1] + b',"x":' + b"[" * 10_000 + b"]" * 10_000 + b"}"), 400),
    # Within the parser's depth limit but deeper than the 254 levels orjson can write back.
    Case(
        "json-nesting-300-in-content",
        lambda c: with_message(
            c,
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "x", "extra": nested(300)}],
            },
        ),
    ),
    Case("json-nesting-300-in-metadata", lambda c: create(c, metadata={"deep": nested(300)})),
    Case("json-nesting-300-in-system", lambda c: create(c, system=[{"type": "text", "text": "s", "x": nested(300)}])),
    Case(
        "relay-truncated-json",
        lambda c: Req("POST", "/v1/messages", {"x-api-key": c.key, "content-type": "application/json"}, GOOD[:20]),
        400,
    ),
    # -- wrong types -------------------------------------------------------------------------------------------------
    Case("messages-missing", lambda c: turn(c, {"model": MODEL, "max_tokens": 64, "thread": {"type": "create"}}), 400),
    Case("messages-object", lambda c: with_messages(c, {"role": "user", "content": "hi"}), 400),
    Case("messages-string", lambda c: with_messages(c, "hello"), 400),
    Case("messages-null", lambda c: with_messages(c, None), 400),
    Case("message-string", lambda c: with_message(c, "hello"), 400),
    Case("message-list", lambda c: with_message(c, [user("hello")]), 400),
    Case("message-null", lambda c: with_message(c, None), 400),
    Case("role-unknown", lambda c: with_message(c, {"role": "robot", "content": "hi"}), 400),
    Case("role-missing", lambda c: with_message(c, {"content": "hi"}), 400),
    Case("role-number", lambda c: with_message(c, {"role": 1, "content": "hi"}), 400),
    Case("content-number", lambda c: with_message(c, {"role": "user", "content": 42}), 400),
    Case("content-missing", lambda c: with_message(c, {"role": "user"}), 400),
    Case("content-null", lambda c: with_message(c, {"role": "user", "content": None}), 400),
    Case("content-object", lambda c: with_message(c, {"role": "user", "content": {"type": "text", "text": "hi"}}), 400),
    Case("stream-string", lambda c: create(c, stream="true"), 400),
    Case("stream-number", lambda c: create(c, stream=1), 400),
    Case("metadata-string", lambda c: create(c, metadata="user-1")),
    Case("metadata-list", lambda c: create(c, metadata=[{"user_id": "u"}])),
    Case("metadata-user-id-number", lambda c: create(c, metadata={"user_id": 12345})),
    Case("metadata-user-id-257-chars", lambda c: create(c, metadata={"user_id": "u" * 257})),
    Case("metadata-user-id-nul", lambda c: create(c, metadata={"user_id": "user\u00001"})),
    Case("system-number", lambda c: create(c, system=42)),
    Case("system-object", lambda c: create(c, system={"text": "be brief"})),
    Case("tools-string", lambda c: create(c, tools="get_weather"), backend_silent=False, statestore_made=False),
    Case("tools-object", lambda c: create(c, tools={"name": "t"}), backend_silent=False, statestore_made=False),
    # -- the thread field --------------------------------------------------------------------------------------------
    Case("thread-string", lambda c: with_thread(c, "create"), 400),
    Case("thread-list", lambda c: with_thread(c, [{"type": "create"}]), 400),
    Case("thread-number", lambda c: with_thread(c, 1), 400),
    Case("thread-true", lambda c: with_thread(c, True), 400),
    Case("thread-empty-object", lambda c: with_thread(c, {}), 400),
    Case("thread-unknown-type", lambda c: with_thread(c, {"type": "fork"}), 400),
    Case("thread-type-number", lambda c: with_thread(c, {"type": 1}), 400),
    Case("thread-type-capitalised", lambda c: with_thread(c, {"type": "Create"}), 400),
    Case(
        "thread-create-extra-key", lambda c: with_thread(c, {"type": "create", "previous_message_id": FORGED_ID}), 400
    ),
    Case("thread-continue-no-id", lambda c: with_thread(c, {"type": "continue"}), 400),
    Case("thread-continue-empty-id", lambda c: continuing(c, ""), 400),
    Case("thread-continue-null-id", lambda c: continuing(c, None), 400),
    Case("thread-continue-number-id", lambda c: continuing(c, 12345), 400),
    Case("thread-continue-list-id", lambda c: continuing(c, [c.victim_head]), 400),
    Case("thread-continue-object-id", lambda c: continuing(c, {"id": c.victim_head}), 400),
    Case(
        "thread-continue-extra-key",
        lambda c: with_thread(c, {"type": "continue", "previous_message_id": FORGED_ID, "fork": True}),
        400,
    ),
    Case("thread-without-beta", lambda c: turn(c, create_body([user("hello")]), beta=False), 400),
    Case(
        "thread-with-other-beta", lambda c: turn(c, GOOD, headers={"anthropic-beta": "message-threads-2026-08-11"}), 400
    ),
    Case("thread-beta-as-substring", lambda c: turn(c, GOOD, headers={"anthropic-beta": f"x{THREADS_BETA}x"}), 400),
    Case(
        "count-tokens-over-other-owners-thread",
        lambda c: Req(
            "POST",
            "/v1/messages/count_tokens",
            thread_headers(c.key),
            _json(continue_body(c.victim_head, [user("count")])),
        ),
        404,
    ),
    Case(
        "count-tokens-with-thread-without-beta",
        lambda c: Req("POST", "/v1/messages/count_tokens", {**thread_headers(c.key), "anthropic-beta": "other"}, GOOD),
        400,
    ),
    # -- ids: forged, truncated, over-long, non-ASCII, of another owner ----------------------------------------------
    Case("continue-other-owners-id", lambda c: continuing(c, c.victim_head), 404),
    Case("continue-truncated-id", lambda c: continuing(c, c.victim_head[:-1]), 404),
    Case("continue-over-long-id", lambda c: continuing(c, c.victim_head + "A"), 404),
    Case("continue-very-long-id", lambda c: continuing(c, "msg_" + "A" * 20_000), 404),
    Case("continue-forged-id", lambda c: continuing(c, FORGED_ID), 404),
    Case("continue-non-ascii-id", lambda c: continuing(c, c.victim_head[:-1] + "é"), 404),
    Case("continue-nul-in-id", lambda c: continuing(c, c.victim_head[:-1] + "\u0000"), 404),
    Case("continue-from-thread-id", lambda c: continuing(c, c.victim_thread), 404),
    Case("get-other-owners-thread", lambda c: get(c, f"/statestore/v1/threads/{c.victim_thread}"), 404),
    Case("export-other-owners-thread", lambda c: get(c, f"/statestore/v1/threads/{c.victim_thread}/messages"), 404),
    Case("delete-other-owners-thread", lambda c: owner(c, "DELETE", f"/statestore/v1/threads/{c.victim_thread}"), 404),
    Case("get-forged-thread-id", lambda c: get(c, "/statestore/v1/threads/thr_" + FORGED_ID[4:26]), 404),
    Case("get-over-long-thread-id", lambda c: get(c, "/statestore/v1/threads/thr_" + "A" * 5000), 404),
    Case("get-non-ascii-thread-id", lambda c: get(c, "/statestore/v1/threads/thr_%C3%A9t%C3%A9"), 404),
    Case("get-nul-thread-id", lambda c: get(c, "/statestore/v1/threads/thr_%00"), 404),
    Case("export-nul-thread-id", lambda c: get(c, "/statestore/v1/threads/thr_%00/messages"), 404),
    Case("delete-nul-thread-id", lambda c: owner(c, "DELETE", "/statestore/v1/threads/thr_%00"), 404),
    # -- session ids (header and path) -------------------------------------------------------------------------------
    Case("session-sql-injection", lambda c: session_turn(c, b"'; DROP TABLE threads; --"), 400),
    Case("session-129-chars", lambda c: session_turn(c, b"s" * 129), 400),
    Case("session-empty", lambda c: session_turn(c, b""), 400),
    Case("session-space", lambda c: session_turn(c, b"a b"), 400),
    Case("session-unicode", lambda c: session_turn(c, "café-☕".encode()), 400),
    Case("session-latin1-byte", lambda c: session_turn(c, b"caf\xe9"), 400),
    Case("session-percent-crlf", lambda c: session_turn(c, b"a%0d%0aSet-Cookie:%20x=1"), 400),
    Case("session-path", lambda c: session_turn(c, b"../../etc/passwd"), 400),
    Case("session-wildcard", lambda c: session_turn(c, b"*"), 400),
    Case("session-bare-cr-raw", lambda c: raw_turn(c, b"statestore-session-id: abc\rSet-Cookie: x=1\r\n"), 400),
    Case("session-nul-raw", lambda c: raw_turn(c, b"statestore-session-id: abc\x00def\r\n"), 400),
    Case("session-obs-fold-raw", lambda c: raw_turn(c, b"statestore-session-id: abc\r\n def\r\n"), 400),
    Case(
        "session-path-sql-injection",
        lambda c: get(c, "/statestore/v1/sessions/%27%3B%20DROP%20TABLE%20threads%3B%20--"),
        400,
    ),
    Case("session-path-129-chars", lambda c: get(c, "/statestore/v1/sessions/" + "s" * 129), 400),
    Case("session-path-unicode", lambda c: get(c, "/statestore/v1/sessions/caf%C3%A9"), 400),
    Case("session-path-crlf", lambda c: get(c, "/statestore/v1/sessions/a%0D%0Ab"), 400),
    Case("session-path-nul", lambda c: get(c, "/statestore/v1/sessions/a%00b"), 400),
    # -- statestore-ttl ----------------------------------------------------------------------------------------------
    Case("ttl-negative", lambda c: ttl(c, b"-5"), 400),
    Case("ttl-zero", lambda c: ttl(c, b"0"), 400),
    Case("ttl-float", lambda c: ttl(c, b"1.5"), 400),
    Case("ttl-text", lambda c: ttl(c, b"forever"), 400),
    Case("ttl-empty", lambda c: ttl(c, b""), 400),
    Case("ttl-exponent", lambda c: ttl(c, b"1e3"), 400),
    Case("ttl-hex", lambda c: ttl(c, b"0x10"), 400),
    Case("ttl-plus-sign", lambda c: ttl(c, b"+5"), 400),
    Case("ttl-unicode-digits", lambda c: ttl(c, "١٢٠".encode()), 400),
    Case("ttl-on-session", lambda c: session_turn(c, b"ttl-session", statestore_ttl=b"-1"), 400),
    # -- content type, method, route ---------------------------------------------------------------------------------
    Case("content-type-text-plain", lambda c: turn(c, GOOD, headers={"content-type": "text/plain"}), 400),
    Case(
        "content-type-missing",
        lambda c: turn(c, GOOD, headers=[(b"x-api-key", c.key.encode()), (b"anthropic-beta", THREADS_BETA.encode())]),
        400,
    ),
    Case(
        "content-type-form", lambda c: turn(c, GOOD, headers={"content-type": "application/x-www-form-urlencoded"}), 400
    ),
    Case("content-type-lookalike", lambda c: turn(c, GOOD, headers={"content-type": "application/jsonp"}), 400),
    Case("method-post-thread-list", lambda c: owner(c, "POST", "/statestore/v1/threads", b"{}"), 405),
    Case("method-patch-thread", lambda c: owner(c, "PATCH", f"/statestore/v1/threads/{c.victim_thread}", b"{}"), 405),
    Case("method-put-session", lambda c: owner(c, "PUT", "/statestore/v1/sessions/abc", b"{}"), 405),
    Case("method-post-healthz", lambda c: owner(c, "POST", "/healthz", b"{}"), 405),
    Case("method-patch-admin-tenants", lambda c: admin("PATCH", "/admin/v1/tenants", {"name": "x"}), 405),
    Case("method-delete-admin-audit", lambda c: admin("DELETE", "/admin/v1/audit"), 405),
    Case("route-unknown", lambda c: get(c, "/nope"), 404),
    Case("route-unknown-admin", lambda c: admin("GET", "/admin/v1/nope"), 404),
    # -- size limits -------------------------------------------------------------------------------------------------
    Case("body-over-limit-content-length", lambda c: create(c, system="s" * MAX_BODY_BYTES), 413),
    Case(
        "body-over-limit-chunked",
        lambda c: Req(
            "POST",
            "/v1/messages",
            thread_headers(c.key),
            _json(create_body([user("hello")], system="s" * MAX_BODY_BYTES)),
            chunked=True,
        ),
        413,
    ),
    Case("body-declared-one-terabyte", lambda c: raw_turn(c, b"", content_length=b"1000000000000"), 413),
    Case("content-length-not-a-number", lambda c: raw_turn(c, b"", content_length=b"12abc"), 400),
    Case(
        "policy-create-too-many-messages", lambda c: with_messages(c, [user(f"m{i}") for i in range(MAX_MESSAGES)]), 400
    ),
    Case("policy-create-too-many-bytes", lambda c: with_message(c, user("b" * MAX_THREAD_BYTES)), 413),
    Case(
        "policy-continue-too-many-messages",
        lambda c: turn(c, continue_body(c.own_head, [user(f"m{i}") for i in range(MAX_MESSAGES - 2)])),
        400,
        own_thread=True,
    ),
    Case(
        "policy-continue-too-many-bytes",
        lambda c: turn(c, continue_body(c.own_head, [user("b" * MAX_THREAD_BYTES)])),
        413,
        own_thread=True,
    ),
    Case(
        "policy-session-too-many-messages",
        lambda c: Req(
            "POST",
            "/v1/messages",
            {**thread_headers(c.key), "statestore-session-id": "big-session"},
            _json({"model": MODEL, "max_tokens": 64, "messages": [user(f"m{i}") for i in range(MAX_MESSAGES)]}),
        ),
        400,
    ),
    # -- credentials -------------------------------------------------------------------------------------------------
    Case(
        "create-without-credentials",
        lambda c: turn(
            c, GOOD, headers=[(b"content-type", b"application/json"), (b"anthropic-beta", THREADS_BETA.encode())]
        ),
        401,
    ),
    Case("create-empty-api-key", lambda c: turn(c, GOOD, headers={"x-api-key": ""}), 401),
    Case(
        "create-bearer-without-token",
        lambda c: turn(
            c,
            GOOD,
            headers=[
                (b"authorization", b"Bearer"),
                (b"content-type", b"application/json"),
                (b"anthropic-beta", THREADS_BETA.encode()),
            ],
        ),
        401,
    ),
    Case("list-without-credentials", lambda c: get(c, "/statestore/v1/threads", auth=False), 401),
    Case(
        "get-thread-without-credentials", lambda c: get(c, f"/statestore/v1/threads/{c.victim_thread}", auth=False), 401
    ),
    # -- thread API: cursors and limits ------------------------------------------------------------------------------
    Case("list-limit-zero", lambda c: get(c, "/statestore/v1/threads?limit=0"), 400),
    Case("list-limit-negative", lambda c: get(c, "/statestore/v1/threads?limit=-1"), 400),
    Case("list-limit-1001", lambda c: get(c, "/statestore/v1/threads?limit=1001"), 400),
    Case("list-limit-text", lambda c: get(c, "/statestore/v1/threads?limit=ten"), 400),
    Case("list-limit-float", lambda c: get(c, "/statestore/v1/threads?limit=2.5"), 400),
    Case("list-limit-huge", lambda c: get(c, "/statestore/v1/threads?limit=" + "9" * 40), 400),
    Case("list-after-garbage", lambda c: get(c, "/statestore/v1/threads?after=not-a-cursor"), 400),
    Case("list-after-sql-injection", lambda c: get(c, "/statestore/v1/threads?after=%27%20OR%20%271%27%3D%271"), 400),
    Case("list-after-other-owners-thread", lambda c: get(c, f"/statestore/v1/threads?after={c.victim_thread}"), 400),
    Case("list-after-nul", lambda c: get(c, "/statestore/v1/threads?after=thr_%00"), 400),
    Case("list-session-id-nul", lambda c: get(c, "/statestore/v1/threads?session_id=a%00b"), 400),
    # -- admin API ---------------------------------------------------------------------------------------------------
    Case("admin-without-token", lambda c: admin("GET", "/admin/v1/tenants", headers={}), 401),
    Case(
        "admin-wrong-token",
        lambda c: admin("GET", "/admin/v1/tenants", headers={"authorization": "Bearer " + "x" * 28}),
        401,
    ),
    Case(
        "admin-token-as-x-api-key", lambda c: admin("GET", "/admin/v1/tenants", headers={"x-api-key": ADMIN_TOKEN}), 401
    ),
    Case(
        "admin-basic-auth",
        lambda c: admin("GET", "/admin/v1/tenants", headers={"authorization": "Basic cm9vdDpwdw=="}),
        401,
    ),
    Case(
        "admin-token-truncated",
        lambda c: admin("GET", "/admin/v1/tenants", headers={"authorization": "Bearer " + ADMIN_TOKEN[:-1]}),
        401,
    ),
    Case("tenant-invalid-json", lambda c: admin("POST", "/admin/v1/tenants", raw=b'{"name": "x"'), 400),
    Case("tenant-array", lambda c: admin("POST", "/admin/v1/tenants", [{"name": "x"}]), 400),
    Case("tenant-empty-object", lambda c: admin("POST", "/admin/v1/tenants", {}), 400),
    Case("tenant-name-empty", lambda c: admin("POST", "/admin/v1/tenants", {"name": ""}), 400),
    Case("tenant-name-blank", lambda c: admin("POST", "/admin/v1/tenants", {"name": "   "}), 400),
    Case("tenant-name-number", lambda c: admin("POST", "/admin/v1/tenants", {"name": 5}), 400),
    Case("tenant-name-null", lambda c: admin("POST", "/admin/v1/tenants", {"name": None}), 400),
    Case("tenant-name-default", lambda c: admin("POST", "/admin/v1/tenants", {"name": "default"}), 400),
    Case("tenant-name-201-chars", lambda c: admin("POST", "/admin/v1/tenants", {"name": "t" * 201}), 400),
    Case("tenant-name-nul", lambda c: admin("POST", "/admin/v1/tenants", {"name": "evil\u0000tenant"}), 400),
    Case("tenant-extra-field", lambda c: admin("POST", "/admin/v1/tenants", {"name": "x", "admin": True}), 400),
    Case("tenant-duplicate", lambda c: admin("POST", "/admin/v1/tenants", {"name": TENANT}), 409),
    Case(
        "tenant-text-plain",
        lambda c: admin(
            "POST", "/admin/v1/tenants", raw=b'{"name": "plain"}', headers={**ADMIN, "content-type": "text/plain"}
        ),
        400,
    ),
    Case("tenant-unknown", lambda c: admin("GET", "/admin/v1/tenants/no-such-tenant"), 404),
    Case("tenant-nul", lambda c: admin("GET", "/admin/v1/tenants/a%00b"), 404),
    Case("tenant-disable-unknown", lambda c: admin("POST", "/admin/v1/tenants/no-such-tenant/disable"), 404),
    Case("keys-unknown-tenant", lambda c: admin("POST", "/admin/v1/tenants/no-such-tenant/keys", {}), 404),
    Case(
        "keys-label-201-chars", lambda c: admin("POST", f"/admin/v1/tenants/{TENANT}/keys", {"label": "l" * 201}), 400
    ),
    Case("keys-label-number", lambda c: admin("POST", f"/admin/v1/tenants/{TENANT}/keys", {"label": 7}), 400),
    Case("keys-extra-field", lambda c: admin("POST", f"/admin/v1/tenants/{TENANT}/keys", {"secret": "mine"}), 400),
    Case("keys-revoke-unknown", lambda c: admin("DELETE", "/admin/v1/keys/key_nope"), 404),
    Case("policy-empty", lambda c: admin("PUT", "/admin/v1/policies/default", {}), 400),
    Case("policy-missing-field", lambda c: admin("PUT", "/admin/v1/policies/default", policy(max_messages=_DROP)), 400),
    Case(
        "policy-string-number", lambda c: admin("PUT", "/admin/v1/policies/default", policy(max_messages="1000")), 400
    ),
    Case("policy-int-as-bool", lambda c: admin("PUT", "/admin/v1/policies/default", policy(threads_enabled=1)), 400),
    Case(
        "policy-negative-ttl", lambda c: admin("PUT", "/admin/v1/policies/default", policy(default_ttl_seconds=-1)), 400
    ),
    Case("policy-zero-messages", lambda c: admin("PUT", "/admin/v1/policies/default", policy(max_messages=0)), 400),
    Case("policy-one-message", lambda c: admin("PUT", "/admin/v1/policies/default", policy(max_messages=1)), 400),
    Case(
        "policy-default-over-max",
        lambda c: admin("PUT", "/admin/v1/policies/default", policy(default_ttl_seconds=7200)),
        400,
    ),
    Case(
        "policy-max-ttl-over-366-days",
        lambda c: admin("PUT", "/admin/v1/policies/default", policy(max_ttl_seconds=366 * 86_400 + 1)),
        400,
    ),
    Case("policy-float", lambda c: admin("PUT", "/admin/v1/policies/default", policy(max_messages=10.5)), 400),
    Case(
        "policy-max-messages-2-pow-31",
        lambda c: admin("PUT", "/admin/v1/policies/default", policy(max_messages=2**31)),
        400,
    ),
    Case(
        "policy-max-thread-bytes-2-pow-63",
        lambda c: admin("PUT", "/admin/v1/policies/default", policy(max_thread_bytes=2**63)),
        400,
    ),
    Case("policy-extra-field", lambda c: admin("PUT", "/admin/v1/policies/default", policy(max_tenants=3)), 400),
    Case("policy-unknown-tenant", lambda c: admin("PUT", "/admin/v1/policies/no-such-tenant", policy()), 404),
    Case("policy-delete-none", lambda c: admin("DELETE", "/admin/v1/policies/default"), 404),
    Case("audit-limit-zero", lambda c: admin("GET", "/admin/v1/audit?limit=0"), 400),
    Case("audit-limit-1001", lambda c: admin("GET", "/admin/v1/audit?limit=1001"), 400),
    Case("audit-before-zero", lambda c: admin("GET", "/admin/v1/audit?before=0"), 400),
    Case("audit-before-text", lambda c: admin("GET", "/admin/v1/audit?before=yesterday"), 400),
    Case("audit-before-2-pow-31", lambda c: admin("GET", f"/admin/v1/audit?before={2**31}"), 400),
    Case("erase-empty", lambda c: admin("POST", "/admin/v1/erase", {}), 400),
    Case("erase-user-id-empty", lambda c: admin("POST", "/admin/v1/erase", {"user_id": ""}), 400),
    Case("erase-user-id-257-chars", lambda c: admin("POST", "/admin/v1/erase", {"user_id": "u" * 257}), 400),
    Case("erase-tenant-number", lambda c: admin("POST", "/admin/v1/erase", {"tenant": 5}), 400),
    Case("erase-unknown-tenant", lambda c: admin("POST", "/admin/v1/erase", {"tenant": "no-such-tenant"}), 404),
    Case("erase-tenant-nul", lambda c: admin("POST", "/admin/v1/erase", {"tenant": "a\u0000b"}), 404),
    Case("stats-unknown-tenant", lambda c: admin("GET", "/admin/v1/stats?tenant=no-such-tenant"), 404),
    Case("stats-tenant-nul", lambda c: admin("GET", "/admin/v1/stats?tenant=a%00b"), 404),
]


def test_the_catalogue_is_large_and_its_ids_unique() -> None:
    ids = [case.id for case in CASES]
    assert len(ids) == len(set(ids))
    assert len(ids) >= 60


# == the server under attack =========================================================================================


@dataclass
class Target:
    server: StatestoreServer
    db: Database
    backend: FakeBackend
    victim_key: str
    victim_thread: str
    victim_head: str


@pytest.fixture(scope="module")
def target(database: Database, redis_url: str, backend_process: FakeBackend) -> Iterator[Target]:
    with servers_on(database, redis_url, backend_process) as servers:
        server = servers.start(
            STATESTORE_MAX_BODY_BYTES=str(MAX_BODY_BYTES),
            STATESTORE_MAX_MESSAGES=str(MAX_MESSAGES),
            STATESTORE_MAX_THREAD_BYTES=str(MAX_THREAD_BYTES),
        )
        victim_key = new_key()
        with httpx.Client(base_url=server.url, timeout=15) as http:
            created = http.post(
                "/v1/messages", headers=thread_headers(victim_key), content=_json(create_body([user("victim")]))
            )
            assert created.status_code == 200, created.text
            tenant = http.post("/admin/v1/tenants", headers=ADMIN, json={"name": TENANT})
            assert tenant.status_code == 201, tenant.text
        yield Target(
            server, database, backend_process, victim_key, created.headers["statestore-thread-id"], created.json()["id"]
        )


@pytest.fixture
async def http(target: Target) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=target.server.url, timeout=20) as client:
        yield client


async def _send_raw(server: StatestoreServer, data: bytes) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(data)
        await writer.drain()
        received = await asyncio.wait_for(reader.read(), timeout=15)
    finally:
        writer.close()
    head, _, body = received.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers, body


async def _chunks(body: bytes) -> AsyncIterator[bytes]:
    for start in range(0, len(body), 8192):
        yield body[start : start + 8192]


async def _send(http: httpx.AsyncClient, server: StatestoreServer, req: Req) -> tuple[int, dict[str, str], bytes]:
    if req.raw is not None:
        return await _send_raw(server, req.raw)
    content: bytes | AsyncIterator[bytes] | None = _chunks(req.body or b"") if req.chunked else req.body
    request = http.build_request(req.method, req.path, headers=req.headers, content=content)
    if req.chunked:
        assert request.headers.get("transfer-encoding") == "chunked"
    response = await http.send(request)
    return response.status_code, dict(response.headers), response.content


async def _listing(http: httpx.AsyncClient, api_key: str) -> Any:
    response = await http.get("/statestore/v1/threads", headers={"x-api-key": api_key})
    assert response.status_code == 200, response.text
    return response.json()


async def _victim_view(http: httpx.AsyncClient, target: Target) -> tuple[Any, bytes]:
    meta = await http.get(f"/statestore/v1/threads/{target.victim_thread}", headers={"x-api-key": target.victim_key})
    export = await http.get(
        f"/statestore/v1/threads/{target.victim_thread}/messages", headers={"x-api-key": target.victim_key}
    )
    assert meta.status_code == 200 and export.status_code == 200, (meta.text, export.text)
    return meta.json(), export.content


@pytest.mark.parametrize("case", [pytest.param(case, id=case.id) for case in CASES])
async def test_hostile_request_is_refused_and_stores_nothing(
    case: Case, target: Target, http: httpx.AsyncClient
) -> None:
    ctx = Ctx(key=new_key(), victim_thread=target.victim_thread, victim_head=target.victim_head)
    if case.own_thread:
        created = await http.post(
            "/v1/messages", headers=thread_headers(ctx.key), content=_json(create_body([user("mine")]))
        )
        assert created.status_code == 200, created.text
        ctx = Ctx(ctx.key, ctx.victim_thread, ctx.victim_head, own_head=created.json()["id"])
    target.backend.reset()
    counts_before = await target.db.counts()
    listing_before = await _listing(http, ctx.key)
    victim_before = await _victim_view(http, target)

    status, headers, content = await _send(http, target.server, case.build(ctx))

    assert 400 <= status < 500, f"{status}: {content[:600]!r}"
    if case.status is not None:
        assert status == case.status, f"{status}: {content[:600]!r}"
    shape = check_error_shape(status, headers, content, statestore_made=case.statestore_made)
    assert not shape["problems"], shape["problems"]
    assert await target.db.counts() == counts_before, "rows were written"
    assert await _listing(http, ctx.key) == listing_before
    assert await _victim_view(http, target) == victim_before
    if case.backend_silent:
        assert target.backend.requests() == [], "the request reached the backend"


# == cases whose right answer is not a 4xx ===========================================================================


def _expires_at(response: httpx.Response) -> datetime:
    return datetime.fromisoformat(response.headers["statestore-expires-at"].replace("Z", "+00:00"))


@pytest.mark.parametrize("digits", [20, 4301, 6000], ids=["20-digits", "4301-digits", "6000-digits"])
async def test_a_huge_ttl_is_clamped_to_the_policy_maximum(
    digits: int, target: Target, http: httpx.AsyncClient
) -> None:
    """docs/protocol.md §5: the header is clamped to the policy's maximum (the default policy: 86400 s). Python refuses
    to convert a string of more than 4300 digits to an int; that must not become a 500."""
    key = new_key()
    response = await http.post(
        "/v1/messages",
        headers=thread_headers(key, **{"statestore-ttl": "9" * digits}),
        content=_json(create_body([user("long-lived")])),
    )
    assert response.status_code < 500, response.text
    if response.status_code == 200:
        granted = _expires_at(response) - datetime.now(UTC)
        assert timedelta(seconds=86_400 - 60) < granted <= timedelta(seconds=86_400 + 5)
    else:
        assert_client_error(response, 400)


async def test_a_refused_session_create_leaves_the_session_usable(target: Target, http: httpx.AsyncClient) -> None:
    """A session create refused for its content (here: a `metadata` nested deeper than can be stored) must neither
    hold the session name nor leave a thread row: the next, valid request on the session goes through at once."""
    key = new_key()
    headers = {**thread_headers(key), "statestore-session-id": "refused-first"}
    body = {"model": MODEL, "max_tokens": 64, "messages": [user("hello")]}
    refused = await http.post("/v1/messages", headers=headers, content=_json({**body, "metadata": {"d": nested(300)}}))
    accepted = await http.post("/v1/messages", headers=headers, content=_json(body))
    assert (refused.status_code < 500, accepted.status_code) == (True, 200), (refused.text, accepted.text)


async def test_erasure_by_a_long_user_id_is_done_and_audited(target: Target, http: httpx.AsyncClient) -> None:
    """`user_id` may be 256 characters (the erase API and the threads column take that many): erasing by one
    succeeds and leaves its audit entry."""
    user_id = "u" * 256
    created = await http.post(
        "/v1/messages",
        headers=thread_headers(new_key()),
        content=_json(create_body([user("to be erased")], metadata={"user_id": user_id})),
    )
    assert created.status_code == 200, created.text
    audit_before = await target.db.counts()
    erased = await http.post("/admin/v1/erase", headers=ADMIN, json={"user_id": user_id})
    assert erased.status_code == 202, erased.text
    state = erased.json()
    for _ in range(600):  # an erasure answers at once and is polled until done (docs/administration.md)
        if state["status"] != "running":
            break
        await asyncio.sleep(0.1)
        state = (await http.get(f"/admin/v1/erasures/{state['id']}", headers=ADMIN)).json()
    assert state["status"] == "done", state
    assert erased_counts(state) == {"erased_threads": 1, "erased_responses": 0, "erased_conversations": 0}
    assert (await target.db.counts())["audit_log"] == audit_before["audit_log"] + 1


async def test_injection_strings_in_query_parameters_are_inert(target: Target, http: httpx.AsyncClient) -> None:
    """An injection string is not a session name: refused with a 400 before any query, and nothing is dropped."""
    counts_before = await target.db.counts()
    for name in ("'; DROP TABLE threads; --", "' OR '1'='1", "\\x27; DELETE FROM sessions; --"):
        response = await http.get(
            "/statestore/v1/threads", params={"session_id": name}, headers={"x-api-key": target.victim_key}
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["type"] == "invalid_request_error"
    assert await target.db.counts() == counts_before
    assert (await _victim_view(http, target))[0]["message_count"] == 2


async def test_a_valid_request_still_works_after_the_catalogue(target: Target, http: httpx.AsyncClient) -> None:
    """The server survived: the victim's thread continues, and nothing of the catalogue leaked into it."""
    target.backend.reset()
    response = await http.post(
        "/v1/messages",
        headers=thread_headers(target.victim_key),
        content=_json(continue_body(target.victim_head, [user("still here?")])),
    )
    assert response.status_code == 200, response.text
    exported = await http.get(
        f"/statestore/v1/threads/{target.victim_thread}/messages", headers={"x-api-key": target.victim_key}
    )
    assert [m["role"] for m in exported.json()["messages"]] == ["user", "assistant", "user", "assistant"]
    assert len(target.backend.requests()) == 1
