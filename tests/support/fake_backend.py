"""A scriptable fake model backend for tests, run as a real server in its own process.

    python -m tests.support.fake_backend --port 0          # prints "listening on http://127.0.0.1:PORT"
    python -m tests.support.fake_backend --port 0 --echo   # the plain echo backend, no control API

Unscripted, it answers like the echo backend (statestore.upstream.echo). It records every request outside
`/_control/` (method, path, query, headers, raw body bytes) so a test in another process can assert exactly what
a backend received. Control API (JSON):

    GET  /_control/health    -> {"ok": true}
    GET  /_control/requests  -> {"requests": [{"method", "path", "raw_path", "query", "headers": [[name, value]...],
                                               "body_b64"}...]}   (latin-1 strings; header names lowercased)
    POST /_control/reset     -> {"ok": true}           forget recorded requests and queued actions
    POST /_control/script    {"actions": [action...]} -> {"queued": <pending count>}   (400 if an action is invalid)
    GET  /_control/script    -> {"pending": <count>}
    POST /_control/context   {"window": N|null, "summary_marker": str|null, "fail_summaries": bool,
                              "record_bodies": bool} -> {"ok": true}   a context window for the echo replies (a
                             request over it gets the API's 400 "prompt is too long"); requests whose last
                             message holds `summary_marker` are summary requests (failed with 529 when
                             `fail_summaries`; on /v1/chat/completions the same, in OpenAI's dialect: a 500, and
                             `context_length_exceeded` over the window); `record_bodies: false` keeps long
                             conversations light (bodies are not recorded)
    GET  /_control/context   -> {"turns": [{"bytes", "input_tokens", "status", "extends_previous"}...],
                                 "summaries": n}   one entry per /v1/messages request that is not a summary:
                             `extends_previous` says whether its body, up to the end of its messages, starts with
                             the previous such request's (the prefix a prompt cache reuses)

With `--tokenizer vllm|llama.cpp` it also serves that server's tokenizer routes (`/tokenize`, `/apply-template`,
tests/support/fake_tokenizers.py), counting as its usage does; with `--no-count-tokens` it has no
`/v1/messages/count_tokens` (a 404 `{"detail": "Not Found"}`, as vLLM answers a route it lacks).

Queued actions are consumed one per `POST /v1/messages`, in order. An action with `"path"` (and optionally
`"method"`, default any) is consumed instead by the first request to that path (any other API a relay carries, such
as `/v1/sessions`); only `raw`, `error` and `close` make sense there. An action with `"match": "<text>"` is consumed
only by a request whose body contains that text (a marker one request carries, so that concurrent requests each meet
the fault meant for them). `GET /_control/requests?after=N` returns the requests recorded after the first N. An action
is an object:

    {"kind": "echo"}                                  the default reply (useful with the shaping fields below)
    {"kind": "message", "message": {...}}             this Message; missing fields are filled in: id (random),
                                                      type, role, model (the request's), stop_reason ("end_turn"),
                                                      stop_sequence (null), usage (input_tokens: the echo estimate
                                                      of the request; output_tokens: ceil(len(JSON of content) / 4)).
                                                      content and any other field are passed through as given.
    {"kind": "error", "status": 529, "error": {"type": "overloaded_error", "message": "Overloaded"},
     "headers": {"retry-after": "1"}}                  an HTTP error in the API's shape (status defaults from type)
    {"kind": "raw", "status": 200, "headers": {...}, "chunks": ["...", ...]}   these body bytes (latin-1), one
                                                      chunk per write, for replies no real backend would send
    {"kind": "close"}                                 close the connection without any response
    {"kind": "chat", "path": "/v1/chat/completions", "message": {...}, "finish_reason": "stop", "usage": {...}}
                                                      a Chat Completions reply with this assistant message (the
                                                      request is checked as strictly as the echo's); "echo" with
                                                      that path is the echo's chat reply, shaping fields apply

and, on any action, "delay_seconds": s (sleep before answering). Shaping for "echo"/"message":

    "cut_after_events": k       stream: send k SSE events, then close the connection (no message_stop and no
                                end of the chunked body); JSON: send half of the body, then close
    "cut_after_bytes": n        JSON: send n bytes of the body, then close
    "stall_after_events": k, "stall_seconds": s   stream: send k events, sleep, then send the rest;
                                JSON: send the headers, sleep, then the body
    "error_after_events": k, "error": {"type", "message"}   stream: send k events, then an `error` event, and end
                                the body cleanly; JSON: answer with that HTTP error instead
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import os
import select
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from statestore.upstream import echo, echo_chat, echo_context, wire
from tests.support import fake_tokenizers

_KINDS = frozenset({"echo", "message", "chat", "error", "raw", "close"})
_NUMBERS = ("delay_seconds", "cut_after_events", "cut_after_bytes", "stall_after_events", "stall_seconds")
_REPO_ROOT = Path(__file__).resolve().parents[2]


def _validate_action(action: object) -> str | None:
    if not isinstance(action, dict):
        return "an action must be an object"
    kind = action.get("kind")
    if kind not in _KINDS:
        return f"unknown kind {kind!r}; expected one of {sorted(_KINDS)}"
    for field in _NUMBERS:
        value = action.get(field)
        if value is not None and (not isinstance(value, int | float) or isinstance(value, bool) or value < 0):
            return f"{field} must be a non-negative number"
    if kind == "chat" and (action.get("path") != echo_chat.PATH or not isinstance(action.get("message"), dict)):
        return f"a chat action needs path {echo_chat.PATH} and a message object"
    if kind == "message" and not isinstance(action.get("message"), dict):
        return "a message action needs a message object"
    if kind == "message" and not isinstance(action["message"].get("content"), list):
        return "message.content must be a list of content blocks"
    if (kind == "error" or "error_after_events" in action) and not isinstance(action.get("error"), dict):
        return "an error needs an error object with type and message"
    if "match" in action and not isinstance(action["match"], str):
        return "match must be a string"
    if kind == "raw" and not all(isinstance(chunk, str) for chunk in action.get("chunks", [])):
        return "raw chunks must be strings"
    return None


def _complete_message(given: Mapping[str, Any], request: Mapping[str, Any]) -> wire.JSONObject:
    model = request.get("model") if isinstance(request.get("model"), str) else echo.MODEL_ID
    content: Sequence[Any] = given["content"]
    output_bytes = len(orjson.dumps(content))
    input_tokens = echo.estimate_input_tokens(request) if isinstance(request, dict) else 0
    defaults = wire.message(
        model=str(model),
        content=[],
        stop_reason="end_turn",
        usage=wire.usage(input_tokens, max(1, echo.estimate_tokens(output_bytes))),
    )
    return {**defaults, **given}


async def _drop_connection(send: Send) -> None:
    """Close the connection now, whatever was or was not sent: ASGI itself has no way to say so.

    uvicorn's `send` is a method of its request cycle, which holds the transport. close() (not abort()) so the
    bytes already written reach the client before the FIN.
    """
    cycle = getattr(send, "__self__", None)
    transport = getattr(cycle, "transport", None)
    if transport is None:
        raise ConnectionAbortedError("fake backend: cannot reach the transport to drop the connection")
    transport.close()
    # Let uvicorn see the disconnect, so it neither answers 500 nor logs an incomplete response.
    for _ in range(50):
        if getattr(cycle, "disconnected", True):
            return
        await asyncio.sleep(0.002)


def _header_pairs(headers: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    return [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()]


@dataclass
class _ContextWatch:
    """The context window and the prefix log of long-conversation tests (see the control API above)."""

    window: int | None = None
    summary_marker: bytes | None = None
    fail_summaries: bool = False
    record_bodies: bool = True
    turns: list[wire.JSONObject] = dataclass_field(default_factory=list)
    summaries: int = 0
    previous: bytes = b""

    def is_summary(self, request: Any) -> bool:
        """A summary request ends with the instructions, which hold the marker (a stored summary may echo it too)."""
        messages = request.get("messages") if isinstance(request, dict) else None
        if self.summary_marker is None or not isinstance(messages, list) or not messages:
            return False
        return self.summary_marker in orjson.dumps(messages[-1])

    def log_turn(self, body: bytes, status: int, input_tokens: int) -> None:
        # A body ends with `]}`: the messages array and the object; what comes before is the reusable prefix.
        extends = bool(self.previous) and body.startswith(self.previous[:-2])
        self.turns.append(
            {"bytes": len(body), "input_tokens": input_tokens, "status": status, "extends_previous": extends}
        )
        self.previous = body


class FakeBackendApp:
    def __init__(self, echo_app: ASGIApp, *, tokenizer: str | None = None, count_tokens: bool = True) -> None:
        """`tokenizer`: the real server whose tokenizer routes the fake serves (tests/support/fake_tokenizers.py);
        `count_tokens`: False, `/v1/messages/count_tokens` is a route it does not have (a 404 as vLLM's FastAPI
        answers one)."""
        self._echo = echo_app
        self._tokenizer = tokenizer
        self._count_tokens = count_tokens
        self._requests: list[wire.JSONObject] = []
        self._script: deque[wire.JSONObject] = deque()
        self._context = _ContextWatch()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._echo(scope, receive, send)
            return
        if scope["path"].startswith("/_control/"):
            await self._control(scope, receive, send)
            return
        body = await echo.read_body(receive, limit=1 << 40) or b""
        self._record(scope, body if self._context.record_bodies else b"")
        if scope["path"] == "/v1/messages" and await self._watch_context(body, send):
            return
        if scope["path"] == echo_chat.PATH and await self._watch_chat_context(body, send):
            return
        action = self._take_action(scope["method"], scope["path"], body)
        if action is not None:
            await self._play(action, body, send)
            return
        if await fake_tokenizers.serve(self._tokenizer, scope["path"], body, send, wire.new_request_id()):
            return
        if not self._count_tokens and scope["path"] == "/v1/messages/count_tokens":
            await echo.send_json(send, 404, b'{"detail":"Not Found"}', wire.new_request_id())
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self._echo(scope, replay, send)

    def _watched(self, body: bytes) -> tuple[_ContextWatch, Any, str] | None:
        """The request the context watch looks at, with a request id for its answer (a summary request counted);
        None when nothing is watched or the body is not JSON."""
        watch = self._context
        if watch.window is None and watch.summary_marker is None:
            return None
        try:
            request = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None
        if watch.is_summary(request):
            watch.summaries += 1
        return watch, request, wire.new_request_id()

    async def _watch_context(self, body: bytes, send: Send) -> bool:
        """Log a request against the context window; True when it was answered here (a failed summary request, or
        a request over the window)."""
        watched = self._watched(body)
        if watched is None:
            return False
        watch, request, request_id = watched
        if watch.is_summary(request):
            if watch.fail_summaries:
                overloaded = wire.error_body("overloaded_error", "Overloaded", request_id)
                await echo.send_json(send, 529, overloaded, request_id)
                return True
            return False
        tokens = echo_context.input_tokens(request) if isinstance(request, dict) else 0
        problem = echo_context.prompt_too_long(tokens, watch.window)
        watch.log_turn(body, 400 if problem else 200, tokens)
        if problem is not None:
            await echo.send_error(send, "invalid_request_error", problem, request_id)
            return True
        return False

    async def _watch_chat_context(self, body: bytes, send: Send) -> bool:
        """`_watch_context` for Chat Completions: a summary request is counted (and failed with a 500 when
        `fail_summaries`); a request over the window is refused as OpenAI does (`code: context_length_exceeded`),
        counted as the echo's usage counts its prompt (a token per four bytes of its messages and tools)."""
        watched = self._watched(body)
        if watched is None:
            return False
        watch, request, request_id = watched
        if watch.is_summary(request):
            if watch.fail_summaries:
                failed = {"error": {"message": "down", "type": "server_error", "param": None, "code": None}}
                await echo.send_json(send, 500, orjson.dumps(failed), request_id)
                return True
            return False
        sized = orjson.dumps(request.get("messages")) + orjson.dumps(request.get("tools") or [])
        tokens = -(-len(sized) // 4)
        over = watch.window is not None and tokens > watch.window
        watch.log_turn(body, 400 if over else 200, tokens)
        if over:
            message = (
                f"This model's maximum context length is {watch.window} tokens. "
                f"However, your messages resulted in {tokens} tokens."
            )
            error = {"message": message, "type": "invalid_request_error", "param": "messages"}
            refused = {"error": {**error, "code": "context_length_exceeded"}}
            await echo.send_json(send, 400, orjson.dumps(refused), request_id)
            return True
        return False

    def _take_action(self, method: str, path: str, body: bytes) -> wire.JSONObject | None:
        for index, action in enumerate(self._script):
            wanted_path = action.get("path", "/v1/messages")
            wanted_method = action.get("method", "POST" if "path" not in action else method)
            marker = action.get("match")
            if marker is not None and marker.encode() not in body:
                continue
            if wanted_path == path and wanted_method == method:
                del self._script[index]
                return action
        return None

    def _record(self, scope: Scope, body: bytes) -> None:
        self._requests.append(
            {
                "method": scope["method"],
                "path": scope["path"],
                "raw_path": (scope.get("raw_path") or scope["path"].encode()).decode("latin-1"),
                "query": scope["query_string"].decode("latin-1"),
                "headers": [[name.decode("latin-1"), value.decode("latin-1")] for name, value in scope["headers"]],
                "body_b64": base64.b64encode(body).decode(),
            }
        )

    async def _control(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = wire.new_request_id()
        route = (scope["method"], scope["path"])
        if route == ("GET", "/_control/health"):
            reply: object = {"ok": True}
        elif route == ("GET", "/_control/requests"):
            reply = {"requests": self._requests}
        elif route == ("POST", "/_control/reset"):
            self._requests.clear()
            self._script.clear()
            self._context = _ContextWatch()
            reply = {"ok": True}
        elif route == ("GET", "/_control/script"):
            reply = {"pending": len(self._script)}
        elif route == ("GET", "/_control/context"):
            reply = {"turns": self._context.turns, "summaries": self._context.summaries}
        elif route == ("POST", "/_control/context"):
            settings = await echo.parse_request(receive, send, request_id)
            if settings is None:
                return
            marker = settings.get("summary_marker")
            self._context = _ContextWatch(
                window=settings.get("window"),
                summary_marker=marker.encode() if isinstance(marker, str) else None,
                fail_summaries=bool(settings.get("fail_summaries")),
                record_bodies=bool(settings.get("record_bodies", True)),
            )
            reply = {"ok": True}
        elif route == ("POST", "/_control/script"):
            request = await echo.parse_request(receive, send, request_id)
            if request is None:
                return
            actions = request.get("actions")
            problems = [_validate_action(a) for a in actions] if isinstance(actions, list) else ["actions: a list"]
            problem = next((p for p in problems if p is not None), None)
            if problem is not None:
                await echo.send_error(send, "invalid_request_error", problem, request_id)
                return
            self._script.extend(actions or ())
            reply = {"queued": len(self._script)}
        else:
            await echo.send_error(send, "not_found_error", f"no control route {route}", request_id)
            return
        await echo.send_json(send, 200, orjson.dumps(reply), request_id)

    async def _play(self, action: wire.JSONObject, body: bytes, send: Send) -> None:
        request_id = wire.new_request_id()
        if action.get("delay_seconds"):
            await asyncio.sleep(float(action["delay_seconds"]))
        kind = action["kind"]
        if kind == "close":
            await _drop_connection(send)
            return
        if kind == "error":
            await self._send_error(send, action, request_id)
            return
        if kind == "raw":
            headers = _header_pairs({"request-id": request_id, **action.get("headers", {})})
            await send({"type": "http.response.start", "status": int(action.get("status", 200)), "headers": headers})
            for chunk in action.get("chunks", []):
                await send({"type": "http.response.body", "body": chunk.encode("latin-1"), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        if action.get("path") == echo_chat.PATH:
            await self._play_chat(action, body, send, request_id)
            return
        try:
            request = orjson.loads(body)
        except orjson.JSONDecodeError:
            request = None
        problem = echo.validate_messages_request(request)
        if problem is not None or not isinstance(request, dict):
            await echo.send_error(send, "invalid_request_error", problem or "invalid request", request_id)
            return
        reply = _complete_message(action["message"], request) if kind == "message" else echo.echo_reply(request)
        if request.get("stream") is True:
            await self._play_stream(action, wire.message_events(reply), send, request_id)
        else:
            await self._play_json(action, orjson.dumps(reply), send, request_id)

    async def _play_chat(self, action: wire.JSONObject, body: bytes, send: Send, request_id: str) -> None:
        """A Chat Completions reply: the echo's, or the scripted message, finish_reason and usage in its place."""
        try:
            request = orjson.loads(body)
        except orjson.JSONDecodeError:
            request = None
        problem = echo_chat.validate_chat_request(request) if isinstance(request, dict) else "a JSON object body"
        if problem is not None or not isinstance(request, dict):
            await echo.send_json(send, 400, echo_chat.chat_error_body(problem or "invalid request"), request_id)
            return
        reply = echo_chat.chat_reply(request)
        if action["kind"] == "chat":
            choice = {**reply["choices"][0], "message": action["message"]}
            choice["finish_reason"] = action.get("finish_reason", "stop")
            reply = {**reply, "choices": [choice], "usage": action.get("usage", reply["usage"])}
        if request.get("stream") is True:
            include_usage = bool((request.get("stream_options") or {}).get("include_usage"))
            await self._play_stream(
                action, echo_chat.chunk_events(reply, include_usage=include_usage), send, request_id
            )
        else:
            await self._play_json(action, orjson.dumps(reply), send, request_id)

    async def _send_error(self, send: Send, action: wire.JSONObject, request_id: str) -> None:
        error: Mapping[str, Any] = action["error"]
        if action.get("path") == echo_chat.PATH:  # OpenAI's error shape
            status = int(action.get("status") or 500)
            body = orjson.dumps({"error": {"param": None, "code": None, **error}})
            await echo.send_json(send, status, body, request_id)
            return
        error_type = str(error.get("type", "api_error"))
        status = int(action.get("status") or wire.ERROR_STATUS.get(error_type, 500))
        extra: dict[str, str] = dict(action.get("headers", {}))
        # A scripted request-id stands in for the generated one, so tests can follow it through a relay.
        request_id = extra.pop("request-id", request_id)
        body = wire.error_body(error_type, str(error.get("message", "")), request_id)
        await echo.send_json(send, status, body, request_id, _header_pairs(extra))

    async def _play_json(self, action: wire.JSONObject, body: bytes, send: Send, request_id: str) -> None:
        if "error_after_events" in action:
            await self._send_error(send, action, request_id)
            return
        cut = action.get("cut_after_bytes")
        if cut is None and action.get("cut_after_events") is not None:
            cut = len(body) // 2
        headers = [(b"content-type", wire.JSON_CONTENT_TYPE), (b"request-id", request_id.encode())]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if action.get("stall_seconds"):
            await asyncio.sleep(float(action["stall_seconds"]))
        if cut is not None:
            await send({"type": "http.response.body", "body": body[: int(cut)], "more_body": True})
            await _drop_connection(send)
            return
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _play_stream(self, action: wire.JSONObject, events: Sequence[bytes], send: Send, request_id: str) -> None:
        cut = action.get("cut_after_events")
        stall = action.get("stall_after_events")
        fail = action.get("error_after_events")
        await echo.send_sse_start(send, request_id)
        for index, event in enumerate(events):
            if index == cut:
                await _drop_connection(send)
                return
            if index == fail:
                error = action["error"]
                failure = wire.error_event(str(error.get("type")), str(error.get("message", "")), request_id)
                await send({"type": "http.response.body", "body": failure, "more_body": True})
                break
            if index == stall:
                await asyncio.sleep(float(action.get("stall_seconds", 0)))
            await send({"type": "http.response.body", "body": event, "more_body": True})
        else:
            if cut is not None:  # at or past the last event: everything arrives but the end of the body
                await _drop_connection(send)
                return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def create_fake_backend_app(*, tokenizer: str | None = None, count_tokens: bool = True) -> ASGIApp:
    return FakeBackendApp(echo.create_echo_app(), tokenizer=tokenizer, count_tokens=count_tokens)


# ---------------------------------------------------------------- the test-side handle


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str
    raw_path: str
    query: str
    headers: tuple[tuple[str, str], ...]
    body: bytes

    def header(self, name: str) -> str | None:
        """The first value of a header (names are compared case-insensitively)."""
        wanted = name.lower()
        return next((value for key, value in self.headers if key == wanted), None)

    def json(self) -> Any:
        return orjson.loads(self.body)


def error_action(
    status: int, error_type: str, message: str, *, headers: Mapping[str, str] | None = None
) -> wire.JSONObject:
    return {"kind": "error", "status": status, "error": {"type": error_type, "message": message}, **_opt(headers)}


def message_action(content: Sequence[Mapping[str, Any]], **fields: Any) -> wire.JSONObject:
    """A scripted reply: `fields` are Message fields (stop_reason, usage, model, id, ...) or shaping fields."""
    shaping = {key: fields.pop(key) for key in list(fields) if key in (*_NUMBERS, "error_after_events", "error")}
    return {"kind": "message", "message": {"content": list(content), **fields}, **shaping}


def chat_action(message: Mapping[str, Any], **fields: Any) -> wire.JSONObject:
    """A scripted Chat Completions reply (`finish_reason`, `usage`, or shaping fields such as cut_after_events)."""
    return {"kind": "chat", "path": echo_chat.PATH, "message": dict(message), **fields}


def _opt(headers: Mapping[str, str] | None) -> wire.JSONObject:
    return {"headers": dict(headers)} if headers else {}


class BackendProcess:
    """A backend server in a child process on a free port; a context manager. Knows nothing of the control API."""

    # Polled until the server answers.
    health_path = "/v1/models"

    def __init__(self, *args: str, startup_timeout: float = 15.0) -> None:
        self._args = args
        self._startup_timeout = startup_timeout
        self._process: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(_REPO_ROOT), os.environ.get("PYTHONPATH")])),
        }
        command = [sys.executable, "-m", "tests.support.fake_backend", "--port", "0", *self._args]
        self._process = subprocess.Popen(command, stdout=subprocess.PIPE, cwd=_REPO_ROOT, env=env)
        assert self._process.stdout is not None
        deadline = time.monotonic() + self._startup_timeout
        ready, _, _ = select.select([self._process.stdout], [], [], self._startup_timeout)
        line = self._process.stdout.readline().decode() if ready else ""
        if not line.startswith("listening on "):
            self.stop()
            raise RuntimeError(f"backend process did not start: {line!r}")
        self.url = line.removeprefix("listening on ").strip()
        while True:
            try:
                httpx.get(self.url + self.health_path, timeout=1.0)
                return
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise
                time.sleep(0.02)

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()

    def __enter__(self) -> BackendProcess:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class FakeBackend(BackendProcess):
    """The scriptable fake backend in a child process: `with FakeBackend() as backend: backend.url ...`."""

    health_path = "/_control/health"

    def __init__(
        self, *, tokenizer: str | None = None, count_tokens: bool = True, startup_timeout: float = 15.0
    ) -> None:
        """`tokenizer`: serve that real server's tokenizer routes (tests/support/fake_tokenizers.py); `count_tokens`:
        False, have no `/v1/messages/count_tokens`."""
        args = (["--tokenizer", tokenizer] if tokenizer else []) + ([] if count_tokens else ["--no-count-tokens"])
        super().__init__(*args, startup_timeout=startup_timeout)
        self._client: httpx.Client | None = None

    def __enter__(self) -> FakeBackend:
        self.start()
        return self

    def _control(self) -> httpx.Client:
        if self._client is None:
            self._client = httpx.Client(base_url=self.url, timeout=10.0)
        return self._client

    def script(self, *actions: Mapping[str, Any]) -> None:
        """Queue actions (see the module docstring) for the next `POST /v1/messages` calls, in order."""
        response = self._control().post("/_control/script", content=orjson.dumps({"actions": list(actions)}))
        if response.status_code != 200:
            raise ValueError(f"fake backend refused the script: {response.text}")

    def pending(self) -> int:
        return int(self._control().get("/_control/script").json()["pending"])

    def requests(self, *, after: int = 0) -> list[RecordedRequest]:
        """The requests recorded so far, leaving out the first `after` (to read a long run's requests in pieces)."""
        recorded = self._control().get("/_control/requests", params={"after": after}).json()["requests"]
        return [
            RecordedRequest(
                method=item["method"],
                path=item["path"],
                raw_path=item["raw_path"],
                query=item["query"],
                headers=tuple((name, value) for name, value in item["headers"]),
                body=base64.b64decode(item["body_b64"]),
            )
            for item in recorded
        ]

    def reset(self) -> None:
        self._control().post("/_control/reset").raise_for_status()

    def watch_context(
        self,
        *,
        window: int | None,
        summary_marker: str | None = None,
        fail_summaries: bool = False,
        record_bodies: bool = False,
    ) -> None:
        """A context window for the replies, and a log of what each turn sent (see the control API)."""
        settings = {
            "window": window,
            "summary_marker": summary_marker,
            "fail_summaries": fail_summaries,
            "record_bodies": record_bodies,
        }
        self._control().post("/_control/context", content=orjson.dumps(settings)).raise_for_status()

    def context_log(self) -> dict[str, Any]:
        log: dict[str, Any] = self._control().get("/_control/context").json()
        return log

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        super().stop()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Fake (or echo) Messages API backend for tests.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--echo", action="store_true", help="serve the plain echo backend, without the control API")
    parser.add_argument("--delay-seconds", type=float, default=0.0)
    parser.add_argument("--reply-bytes", type=int, default=None)
    parser.add_argument("--tokenizer", choices=fake_tokenizers.DIALECTS, help="serve this server's tokenizer routes")
    parser.add_argument("--no-count-tokens", action="store_true", help="have no /v1/messages/count_tokens")
    args = parser.parse_args(argv)
    if args.echo:
        app = echo.create_echo_app(delay_seconds=args.delay_seconds, reply_bytes=args.reply_bytes)
    else:
        app = create_fake_backend_app(tokenizer=args.tokenizer, count_tokens=not args.no_count_tokens)
    # Bound here, not by uvicorn, so the port is known (and reported) before serving, with no race for it.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(1024)
    print(f"listening on http://{args.host}:{sock.getsockname()[1]}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        echo.serve_asgi(app, sock=sock)


if __name__ == "__main__":
    main()
