"""Request context, body limit, logs and metrics, through a small FastAPI app wired as the real one is."""

from __future__ import annotations

import asyncio
import io
import logging
import logging.config
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel
from starlette.types import Message, Receive, Scope, Send

import statestore.logs
from statestore.errors import ThreadNotFound
from statestore.logs import JsonFormatter, configure_logging, new_request_id, uvicorn_log_config
from statestore.metrics import Metrics
from statestore.middleware import (
    BodySizeLimitMiddleware,
    RequestContextMiddleware,
    send_error,
)

LIMIT = 1024
SENTINEL = "SENTINEL-private-message-content-7f3a"
REQUEST_ID = re.compile(r"^req_[A-Za-z0-9]{24}$")


class Turn(BaseModel):
    text: str


async def _chunks(count: int, size: int) -> AsyncIterator[bytes]:
    for _ in range(count):
        yield b"x" * size


def build_app(metrics: Metrics) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/messages")
    async def messages(request: Request) -> JSONResponse:
        body = await request.body()
        return JSONResponse({"received": len(body)})

    @app.post("/v1/typed")
    async def typed(turn: Turn) -> dict[str, int]:
        return {"length": len(turn.text)}

    @app.get("/statestore/v1/threads/{thread_id}")
    async def get_thread(thread_id: str) -> dict[str, str]:
        return {"id": thread_id}

    @app.post("/v1/boom")
    async def boom(request: Request) -> None:
        body = await request.body()
        raise ValueError(f"cannot handle {body.decode()}")

    @app.get("/v1/rejected")
    async def rejected() -> None:
        raise ThreadNotFound("thread not found")

    @app.post("/v1/responses")
    async def responses_boom(request: Request) -> None:
        await request.body()
        raise ValueError("the Responses door failed")

    @app.get("/v1/relayed")
    async def relayed() -> Response:
        return Response(b"{}", media_type="application/json", headers={"Request-Id": "req_backend"})

    @app.get("/v1/stream")
    async def stream() -> StreamingResponse:
        async def events() -> AsyncIterator[bytes]:
            yield b"event: one\n\n"
            await asyncio.sleep(0.05)
            yield b"event: two\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/v1/cut")
    async def cut() -> StreamingResponse:
        async def events() -> AsyncIterator[bytes]:
            yield b"event: one\n\n"
            raise RuntimeError("backend went away")

        return StreamingResponse(events(), media_type="text/event-stream")

    app.add_middleware(BodySizeLimitMiddleware, max_bytes=LIMIT)
    # As statestore.app wires it: the default resolver finds the app in scope["app"].
    app.add_middleware(RequestContextMiddleware, metrics=metrics)
    return app


@pytest.fixture
def metrics() -> Metrics:
    return Metrics()


@pytest.fixture
async def client(metrics: Metrics) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=build_app(metrics), client=("203.0.113.7", 4711))
    async with httpx.AsyncClient(transport=transport, base_url="http://statestore") as http:
        yield http


@pytest.fixture
def logs() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    # The test's own httpx client logs the URLs it requests; only the server side is under test.
    handler.addFilter(lambda record: not record.name.startswith("httpx"))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield stream
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def log_lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in stream.getvalue().splitlines()]


def access_lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [line for line in log_lines(stream) if line["logger"] == "statestore.access"]


def samples(metrics: Metrics, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    found: dict[tuple[tuple[str, str], ...], float] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == name:
                found[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def assert_anthropic_error(response: httpx.Response, status: int, error_type: str) -> dict[str, Any]:
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    body: dict[str, Any] = response.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == error_type
    assert REQUEST_ID.match(body["request_id"])
    assert response.headers.get_list("request-id") == [body["request_id"]]
    return body


# --- request id ---------------------------------------------------------------------------------


async def test_request_id_header_is_added(client: httpx.AsyncClient) -> None:
    first = await client.get("/statestore/v1/threads/thr_1")
    second = await client.get("/statestore/v1/threads/thr_1")
    assert first.status_code == 200
    assert REQUEST_ID.match(first.headers["request-id"])
    assert first.headers["request-id"] != second.headers["request-id"]


async def test_relayed_request_id_is_kept_and_not_duplicated(client: httpx.AsyncClient) -> None:
    response = await client.get("/v1/relayed")
    assert response.headers.get_list("request-id") == ["req_backend"]


async def test_request_id_reaches_scope_state_and_logs(logs: io.StringIO) -> None:
    seen: dict[str, Any] = {}

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen["state"] = scope["state"]["request_id"]
        logging.getLogger("statestore.test").info("inside")
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    wrapped = RequestContextMiddleware(app, Metrics(), route_resolver=lambda scope: "/x")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=wrapped), base_url="http://s") as http:
        response = await http.get("/x")
    assert response.headers["request-id"] == seen["state"]
    inside = next(line for line in log_lines(logs) if line["msg"] == "inside")
    assert inside["request_id"] == seen["state"]


def test_new_request_id_shape() -> None:
    ids = {new_request_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(REQUEST_ID.match(i) for i in ids)


# --- errors -------------------------------------------------------------------------------------


async def test_unhandled_exception_is_a_json_500_and_logged_without_content(
    client: httpx.AsyncClient, logs: io.StringIO
) -> None:
    response = await client.post(f"/v1/boom?q={SENTINEL}", content=SENTINEL.encode())
    body = assert_anthropic_error(response, 500, "api_error")
    assert body["error"]["message"] == "internal error"
    assert "<html" not in response.text.lower()

    failure = next(line for line in log_lines(logs) if line["level"] == "ERROR")
    assert failure["request_id"] == body["request_id"]
    assert failure["exc_type"] == "ValueError"
    assert "in boom" in failure["traceback"]
    assert SENTINEL not in logs.getvalue()


async def test_statestore_error_escaping_the_app_keeps_its_status(client: httpx.AsyncClient) -> None:
    response = await client.get("/v1/rejected")
    body = assert_anthropic_error(response, 404, "not_found_error")
    assert body["error"]["details"] == {"error_code": "thread_not_found"}
    assert response.headers["x-should-retry"] == "false"


def assert_openai_error(response: httpx.Response, status: int, error_type: str) -> dict[str, Any]:
    assert response.status_code == status
    body: dict[str, Any] = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == error_type
    return body


async def test_an_unhandled_exception_on_the_responses_door_is_a_500_in_openais_shape(
    client: httpx.AsyncClient,
) -> None:
    response = await client.post("/v1/responses", content=b"{}")
    body = assert_openai_error(response, 500, "server_error")
    assert body["error"]["message"] == "internal error"


async def test_a_body_over_the_limit_on_the_responses_door_is_a_413_in_openais_shape(
    client: httpx.AsyncClient,
) -> None:
    response = await client.post("/v1/responses", content=_chunks(8, 256))
    body = assert_openai_error(response, 413, "invalid_request_error")
    assert str(LIMIT) in body["error"]["message"]


async def test_the_app_reads_the_body_whole_then_sees_the_disconnect() -> None:
    seen: list[Message] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(await receive())
        seen.append(await receive())
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    incoming: list[Message] = [
        {"type": "http.request", "body": b"ab", "more_body": True},
        {"type": "http.request", "body": b"cd", "more_body": False},
        {"type": "http.disconnect"},
    ]

    async def receive() -> Message:
        return incoming.pop(0)

    async def send(message: Message) -> None:
        pass

    scope: Scope = {"type": "http", "method": "POST", "path": "/v1/messages", "headers": []}
    await BodySizeLimitMiddleware(app, max_bytes=LIMIT)(scope, receive, send)
    assert seen == [{"type": "http.request", "body": b"abcd", "more_body": False}, {"type": "http.disconnect"}]


async def test_app_returning_without_a_response_gets_a_json_500() -> None:
    async def silent(scope: Scope, receive: Receive, send: Send) -> None:
        return None

    wrapped = RequestContextMiddleware(silent, Metrics(), route_resolver=lambda scope: "/x")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=wrapped), base_url="http://s") as http:
        response = await http.get("/x")
    assert_anthropic_error(response, 500, "api_error")


async def test_failure_after_response_start_is_logged_and_raised(client: httpx.AsyncClient, logs: io.StringIO) -> None:
    with pytest.raises(RuntimeError, match="backend went away"):
        await client.get("/v1/cut")
    failure = next(line for line in log_lines(logs) if line["msg"] == "request failed after its response started")
    assert failure["exc_type"] == "RuntimeError"
    access = access_lines(logs)[-1]
    assert access["status"] == 200
    assert access["complete"] is False


async def test_send_error_writes_a_complete_response() -> None:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    await send_error(
        send, ThreadNotFound("thread not found"), {"path": "/v1/messages", "state": {"request_id": "req_abc"}}
    )
    start, body = sent
    headers = dict(start["headers"])
    assert start["status"] == 404
    assert headers[b"content-type"] == b"application/json"
    assert headers[b"request-id"] == b"req_abc"
    assert headers[b"x-should-retry"] == b"false"
    assert int(headers[b"content-length"]) == len(body["body"])
    assert orjson.loads(body["body"])["request_id"] == "req_abc"
    assert body.get("more_body", False) is False


# --- body size limit ----------------------------------------------------------------------------


async def test_declared_length_over_limit_is_413_before_the_app_runs() -> None:
    called = False

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal called
        called = True

    limited = BodySizeLimitMiddleware(app, max_bytes=LIMIT)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=limited), base_url="http://s") as http:
        response = await http.post("/v1/messages", content=b"x" * (LIMIT + 1))
    body = assert_anthropic_error(response, 413, "request_too_large")
    assert body["error"]["message"] == f"request body exceeds {LIMIT} bytes"
    assert not called


async def test_declared_length_over_limit_through_the_app(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/messages", content=b"x" * (LIMIT + 1))
    assert_anthropic_error(response, 413, "request_too_large")


async def test_body_at_limit_is_accepted(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/messages", content=_chunks(4, LIMIT // 4))
    assert response.status_code == 200
    assert response.json() == {"received": LIMIT}


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/typed"])
async def test_chunked_body_past_limit_is_413(client: httpx.AsyncClient, path: str) -> None:
    # /v1/typed: FastAPI turns a failed body read into its own 400; the 413 must still win.
    response = await client.post(path, content=_chunks(8, 256), headers={"content-type": "application/json"})
    assert "content-length" not in response.request.headers
    body = assert_anthropic_error(response, 413, "request_too_large")
    assert str(LIMIT) in body["error"]["message"]


# --- metrics ------------------------------------------------------------------------------------


async def test_requests_are_counted_by_route_template(client: httpx.AsyncClient, metrics: Metrics) -> None:
    await client.get("/statestore/v1/threads/thr_aaa")
    await client.get("/statestore/v1/threads/thr_bbb")
    await client.get("/nowhere/thr_ccc")
    await client.post("/statestore/v1/threads/thr_ddd")  # wrong method: still the route's template

    counts = samples(metrics, "http_requests_total")
    assert counts[(("method", "GET"), ("route", "/statestore/v1/threads/{thread_id}"), ("status", "200"))] == 2
    assert counts[(("method", "GET"), ("route", "other"), ("status", "404"))] == 1
    assert counts[(("method", "POST"), ("route", "/statestore/v1/threads/{thread_id}"), ("status", "405"))] == 1
    rendered = metrics.render()[0].decode()
    assert "thr_" not in rendered
    durations = samples(metrics, "http_request_duration_seconds_count")
    assert durations[(("method", "GET"), ("route", "/statestore/v1/threads/{thread_id}"))] == 2


async def test_streaming_duration_runs_to_the_last_chunk(
    client: httpx.AsyncClient, metrics: Metrics, logs: io.StringIO
) -> None:
    response = await client.get("/v1/stream")
    assert response.text == "event: one\n\nevent: two\n\n"
    line = access_lines(logs)[-1]
    assert line["duration_ms"] >= 50
    assert line["bytes_out"] == len(response.content)
    total = samples(metrics, "http_request_duration_seconds_sum")
    assert total[(("method", "GET"), ("route", "/v1/stream"))] >= 0.05


def test_domain_counters_start_at_zero_and_count() -> None:
    metrics = Metrics()
    metrics.count_thread_turn("continue", "stored")
    metrics.count_cache_lookup("stale")
    metrics.count_upstream_error("timeout")
    metrics.observe_upstream("/v1/messages", "ok", 0.2)
    metrics.observe_request("/v1/messages", "BREW", 200, 0.01)

    metrics.count_response_turn("conversation", "not_stored")

    turns = samples(metrics, "thread_turns_total")
    assert len(turns) == 6
    assert turns[(("kind", "continue"), ("outcome", "stored"))] == 1
    assert turns[(("kind", "create"), ("outcome", "rejected"))] == 0
    # By front door: the Messages door's two kinds and the Responses door's three, each with every outcome.
    by_door = samples(metrics, "turns_total")
    assert len(by_door) == (2 + 3) * 3
    assert by_door[(("door", "messages"), ("kind", "continue"), ("outcome", "stored"))] == 1
    assert by_door[(("door", "responses"), ("kind", "conversation"), ("outcome", "not_stored"))] == 1
    assert sum(by_door.values()) == 2
    assert (("door", "messages"), ("kind", "conversation"), ("outcome", "stored")) not in by_door
    assert samples(metrics, "cache_lookups_total")[(("result", "stale"),)] == 1
    assert samples(metrics, "upstream_errors_total")[(("kind", "timeout"),)] == 1
    assert samples(metrics, "upstream_request_duration_seconds_count")[(("outcome", "ok"), ("route", "/v1/messages"))]
    # Arbitrary methods collapse into one label value.
    assert (("method", "other"), ("route", "/v1/messages"), ("status", "200")) in samples(
        metrics, "http_requests_total"
    )


def _two_workers(directory: Path, script: str, first: str, second: str) -> str:
    """`script` run as two worker processes one after the other, sharing a metrics directory; the second's output."""
    env = {"PROMETHEUS_MULTIPROC_DIR": str(directory), "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", script, first], env=env, check=True, timeout=60)
    run = [sys.executable, "-c", script, second]
    return subprocess.run(run, env=env, check=True, timeout=60, capture_output=True, text=True).stdout


def test_multiprocess_render_merges_workers(tmp_path: Path) -> None:
    script = (
        "import sys\n"
        "from statestore.metrics import Metrics\n"
        "m = Metrics()\n"
        "m.count_cache_lookup('hit')\n"
        "if sys.argv[1] == 'render':\n"
        "    sys.stdout.write(m.render()[0].decode())\n"
    )
    assert 'cache_lookups_total{result="hit"} 2.0' in _two_workers(tmp_path, script, "count", "render")


def test_multiprocess_render_forgets_the_live_gauges_of_a_killed_worker(tmp_path: Path) -> None:
    """A worker that dies with WebSocket connections open cannot close them: its connections and held bytes are not
    counted on by the next scrape, while a live worker's are."""
    script = (
        "import os, sys\n"
        "from statestore.metrics import Metrics\n"
        "m = Metrics()\n"
        "m.declare_websocket_route('/v1/responses')\n"
        "if sys.argv[1] == 'die':\n"
        "    m.websocket_opened('/v1/responses')\n"
        "    m.websocket_held_bytes('/v1/responses')(1000)\n"
        "    os._exit(0)\n"
        "m.websocket_opened('/v1/responses')\n"
        "sys.stdout.write(m.render()[0].decode())\n"
    )
    out = _two_workers(tmp_path, script, "die", "render")
    assert 'websocket_connections{route="/v1/responses"} 1.0' in out  # the live one's only
    assert 'websocket_held_bytes{route="/v1/responses"} 0.0' in out


async def test_route_label_is_the_matched_template() -> None:
    metrics = Metrics()
    app = FastAPI()

    @app.get("/statestore/v1/threads/{thread_id}")
    async def endpoint(thread_id: str) -> dict[str, str]:
        return {}

    app.add_middleware(RequestContextMiddleware, metrics=metrics)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        await client.get("/statestore/v1/threads/thr_abc")
        await client.get("/nowhere/thr_abc")
    text = metrics.render()[0].decode()
    assert 'route="/statestore/v1/threads/{thread_id}"' in text
    assert 'route="other"' in text
    assert "thr_abc" not in text


async def test_non_http_scopes_pass_through() -> None:
    seen: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(scope["type"])

    async def receive() -> Message:
        return {"type": "lifespan.startup"}

    async def send(message: Message) -> None:
        return None

    scope: Scope = {"type": "lifespan"}
    await RequestContextMiddleware(app, Metrics())(scope, receive, send)
    await BodySizeLimitMiddleware(app, max_bytes=1)(scope, receive, send)
    assert seen == ["lifespan", "lifespan"]
    assert "state" not in scope


# --- logs ---------------------------------------------------------------------------------------


async def test_access_log_line_has_fields_and_no_content(client: httpx.AsyncClient, logs: io.StringIO) -> None:
    response = await client.post(
        f"/v1/messages?user={SENTINEL}", content=orjson.dumps({"messages": [{"content": SENTINEL}]})
    )
    assert response.status_code == 200
    (line,) = access_lines(logs)
    assert line["level"] == "INFO"
    assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$", line["ts"])
    assert line["request_id"] == response.headers["request-id"]
    assert line["method"] == "POST"
    assert line["route"] == "/v1/messages"
    assert line["status"] == 200
    assert line["duration_ms"] >= 0
    assert line["bytes_out"] == len(response.content)
    assert line["client_ip"] == "203.0.113.7"
    assert line["complete"] is True
    assert SENTINEL not in logs.getvalue()


def test_exception_rendering_withholds_messages_but_keeps_chain() -> None:
    logger = logging.getLogger("statestore.test.render")
    record: logging.LogRecord | None = None
    try:
        try:
            raise OSError(111, "Connection refused")
        except OSError as cause:
            raise ValueError(SENTINEL) from cause
    except ValueError:
        record = logger.makeRecord(logger.name, logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    line = orjson.loads(JsonFormatter().format(record))
    assert line["exc_type"] == "ValueError"
    assert line["exc"] == "<message withheld>"
    assert "Connection refused" in line["traceback"]
    assert "direct cause" in line["traceback"]
    assert SENTINEL not in orjson.dumps(line).decode()


@pytest.fixture
def restore_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(statestore.logs, "_configured", None)
    names = ["", "uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi"]
    saved = {
        n: (logging.getLogger(n).handlers[:], logging.getLogger(n).level, logging.getLogger(n).propagate) for n in names
    }
    try:
        yield
    finally:
        for name, (handlers, level, propagate) in saved.items():
            target = logging.getLogger(name)
            target.handlers[:] = handlers
            target.setLevel(level)
            target.propagate = propagate


@pytest.mark.usefixtures("restore_logging")
def test_configure_logging_json_routes_uvicorn_through_our_handler(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("INFO", json=True)
    logging.getLogger("uvicorn.error").info("Started server process [%d]", 42, extra={"color_message": "\x1b[1m"})
    logging.getLogger("statestore.test").debug("hidden at INFO")
    logging.getLogger("httpx").info("HTTP Request: POST https://backend/v1/messages?q=x")
    (line,) = [orjson.loads(raw) for raw in capsys.readouterr().err.splitlines()]
    assert line["logger"] == "uvicorn.error"
    assert line["msg"] == "Started server process [42]"
    assert "color_message" not in line
    assert "request_id" not in line


@pytest.mark.usefixtures("restore_logging")
def test_configure_logging_plain_is_readable(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("DEBUG", json=False)
    logging.getLogger("statestore.access").info("request", extra={"route": "/v1/messages", "status": 200})
    err = capsys.readouterr().err
    assert re.match(r"^\S+Z INFO +statestore\.access request route=/v1/messages status=200$", err.strip())


@pytest.mark.usefixtures("restore_logging")
def test_uvicorn_log_config_follows_configure_logging(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("WARNING", json=False)
    config = uvicorn_log_config()
    assert config is not None
    assert config["root"]["level"] == "WARNING"
    assert config["formatters"]["default"]["()"] == "statestore.logs.PlainFormatter"
    # What a spawned worker does with it: apply it again from scratch.
    logging.config.dictConfig(config)
    logging.getLogger("uvicorn.error").warning("worker up")
    assert capsys.readouterr().err.strip().endswith("WARNING uvicorn.error worker up")


@pytest.mark.usefixtures("restore_logging")
def test_uvicorn_log_config_survives_use_colors() -> None:
    config = uvicorn_log_config("INFO", json=True)
    assert config is not None
    # uvicorn writes use_colors into these two formatters when run with --use-colors / --no-use-colors.
    config["formatters"]["default"]["use_colors"] = False
    config["formatters"]["access"]["use_colors"] = False
    logging.config.dictConfig(config)
    assert config["loggers"]["uvicorn.access"]["handlers"] == []
    assert config["disable_existing_loggers"] is False
