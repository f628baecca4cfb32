"""The stateless relay (issue: foundation): the official SDK through statestore gets what the backend sent."""

from __future__ import annotations

import socket
from typing import Any

import anthropic
import httpx
import httpx2
import orjson
import pytest

from tests.support.fake_backend import FakeBackend, error_action, message_action
from tests.support.server import StatestoreServer

RICH_CONTENT: list[dict[str, Any]] = [
    {"type": "thinking", "thinking": "Let me look at the weather.", "signature": "sig-abc123=="},
    {"type": "text", "text": "I'll check the weather for you."},
    {"type": "tool_use", "id": "toolu_01A", "name": "get_weather", "input": {"city": "Paris", "days": [1, 2]}},
]
REQUEST: dict[str, Any] = {
    "model": "claude-test",
    "max_tokens": 256,
    "messages": [{"role": "user", "content": "weather in Paris?"}],
}


def _raw_create(base_url: str, api_key: str, **extra: Any) -> httpx.Response:
    body = {**REQUEST, **extra}
    return httpx.post(
        f"{base_url}/v1/messages",
        content=orjson.dumps(body),
        headers={"content-type": "application/json", "x-api-key": api_key, "anthropic-version": "2023-06-01"},
        timeout=10,
    )


@pytest.mark.parametrize("stream", [False, True])
def test_sdk_result_is_byte_identical_to_the_backend(
    server: StatestoreServer, backend: FakeBackend, api_key: str, stream: bool
) -> None:
    reply = message_action(RICH_CONTENT, id="msg_fixed01", stop_reason="tool_use")
    backend.script(reply, reply)
    direct = _raw_create(backend.url, api_key, stream=stream)
    relayed = _raw_create(server.url, api_key, stream=stream)
    assert relayed.status_code == direct.status_code == 200
    assert relayed.content == direct.content
    assert relayed.headers["content-type"] == direct.headers["content-type"]
    sent = backend.requests()
    assert sent[0].body == sent[1].body  # the request went through unchanged


def test_sdk_create_and_stream_match_direct_calls(server: StatestoreServer, backend: FakeBackend, api_key: str) -> None:
    reply = message_action(RICH_CONTENT, id="msg_fixed02", stop_reason="tool_use")
    backend.script(reply, reply, reply, reply)
    with (
        anthropic.Anthropic(base_url=backend.url, api_key=api_key, max_retries=0) as direct,
        anthropic.Anthropic(base_url=server.url, api_key=api_key, max_retries=0) as relayed,
    ):
        kwargs: Any = {"model": "claude-test", "max_tokens": 256, "messages": REQUEST["messages"]}
        a = direct.messages.create(**kwargs)
        b = relayed.messages.create(**kwargs)
        assert b.model_dump() == a.model_dump()
        with direct.messages.stream(**kwargs) as s:
            sa = s.get_final_message()
        with relayed.messages.stream(**kwargs) as s:
            sb = s.get_final_message()
        assert sb.model_dump() == sa.model_dump() == a.model_dump()
        assert [block.type for block in sb.content] == ["thinking", "text", "tool_use"]


@pytest.mark.parametrize(
    ("status", "error_type", "exc", "headers"),
    [
        (400, "invalid_request_error", anthropic.BadRequestError, {"request-id": "req_from_backend_400"}),
        (
            429,
            "rate_limit_error",
            anthropic.RateLimitError,
            {"retry-after": "7", "anthropic-ratelimit-requests-remaining": "0"},
        ),
        (500, "api_error", anthropic.InternalServerError, {}),
        (529, "overloaded_error", anthropic.OverloadedError, {}),
    ],
)
def test_backend_errors_are_relayed(
    client: anthropic.Anthropic,
    backend: FakeBackend,
    status: int,
    error_type: str,
    exc: type[anthropic.APIStatusError],
    headers: dict[str, str],
) -> None:
    backend.script(error_action(status, error_type, "scripted failure", headers=headers))
    with pytest.raises(exc) as raised:
        client.messages.create(model="claude-test", max_tokens=10, messages=[{"role": "user", "content": "hi"}])
    error = raised.value
    assert error.status_code == status
    assert isinstance(error.body, dict)
    assert error.body["error"] == {"type": error_type, "message": "scripted failure"}
    for name, value in headers.items():
        assert error.response.headers[name] == value
    assert error.response.headers["request-id"].startswith("req_")


def test_cut_stream_is_relayed_as_cut(client: anthropic.Anthropic, backend: FakeBackend) -> None:
    backend.script(message_action(RICH_CONTENT, cut_after_events=4))
    events: list[str] = []
    # The SDK lets the transport's error through for a stream cut mid-body.
    with (
        pytest.raises((httpx2.TransportError, anthropic.APIConnectionError)),
        client.messages.stream(model="claude-test", max_tokens=10, messages=REQUEST["messages"]) as stream,
    ):
        for event in stream:
            events.append(event.type)
        stream.get_final_message()
    assert "message_stop" not in events
    assert events[0] == "message_start"


def test_models_and_count_tokens_are_relayed(client: anthropic.Anthropic, backend: FakeBackend) -> None:
    models = client.models.list()
    assert [m.id for m in models.data]
    one = client.models.retrieve(models.data[0].id)
    assert one.id == models.data[0].id
    with pytest.raises(anthropic.NotFoundError):
        client.models.retrieve("no-such-model")
    counted = client.messages.count_tokens(model="claude-test", messages=[{"role": "user", "content": "x" * 400}])
    assert counted.input_tokens > 100
    assert {r.path for r in backend.requests()} >= {"/v1/models", "/v1/messages/count_tokens"}


def test_credentials_are_forwarded_and_statestore_headers_are_not(
    pg_server: StatestoreServer, backend: FakeBackend, api_key: str
) -> None:
    response = httpx.post(
        f"{pg_server.url}/v1/messages?beta=true",
        content=orjson.dumps(REQUEST),
        headers={
            "content-type": "application/json",
            "x-api-key": api_key,
            "anthropic-beta": "message-threads-2026-08-12, other-beta-2025-01-01",
            "statestore-ttl": "60",
            "connection": "keep-alive",
            "expect": "100-continue",
        },
    )
    assert response.status_code == 200
    [seen] = backend.requests()
    assert seen.header("expect") is None  # the body was read whole: the backend is not asked for leave to send it
    assert seen.header("x-api-key") == api_key
    assert seen.header("anthropic-beta") == "other-beta-2025-01-01"
    assert seen.header("statestore-ttl") is None
    assert seen.query == "beta=true"


# -- what statestore itself rejects ----------------------------------------------------------------------------


def _error(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert body["type"] == "error"
    assert response.headers["request-id"].startswith("req_")
    assert body["request_id"] == response.headers["request-id"]
    assert response.headers["content-type"].startswith("application/json")
    error: dict[str, Any] = body["error"]
    return error


@pytest.mark.parametrize(
    ("body", "content_type", "fragment"),
    [
        (b'{"model": "x", "max_tokens": ', "application/json", "not valid JSON"),
        (b"[1, 2, 3]", "application/json", "must be a JSON object"),
        (b'{"model": "x"}', "text/plain", "content-type"),
        (b"\xff\xfe{}", "application/json", "not valid JSON"),
    ],
)
def test_malformed_requests_get_anthropic_errors(
    server: StatestoreServer, backend: FakeBackend, body: bytes, content_type: str, fragment: str
) -> None:
    response = httpx.post(
        f"{server.url}/v1/messages", content=body, headers={"content-type": content_type, "x-api-key": "k"}
    )
    assert response.status_code == 400
    error = _error(response)
    assert error["type"] == "invalid_request_error"
    assert fragment in error["message"]
    assert backend.requests() == []


def test_unknown_routes_and_methods(pg_server: StatestoreServer) -> None:
    response = httpx.get(f"{pg_server.url}/nowhere")
    assert response.status_code == 404
    assert _error(response)["type"] == "not_found_error"
    response = httpx.delete(f"{pg_server.url}/healthz")
    assert response.status_code == 405
    assert _error(response)["type"] == "invalid_request_error"


def test_count_tokens_refuses_a_thread_without_the_threads_beta(
    client: anthropic.Anthropic, backend: FakeBackend
) -> None:
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.count_tokens(
            model="claude-test",
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"thread": {"type": "create"}},
        )
    assert "message-threads-2026-08-12" in raised.value.message
    assert backend.requests() == []


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_oversized_body_unreachable_and_slow_backend(
    migrated_pg_url: str, redis_url: str, server_redis_prefix: str, backend: FakeBackend
) -> None:
    unreachable = StatestoreServer(
        database_url=migrated_pg_url,
        upstream_url=f"http://127.0.0.1:{_closed_port()}",
        redis_url=redis_url,
        redis_prefix=server_redis_prefix,
        env={"STATESTORE_MAX_BODY_BYTES": "4096"},
    )
    try:
        response = _raw_create(unreachable.url, "k")
        assert response.status_code == 502
        assert _error(response)["type"] == "api_error"
        big = _raw_create(unreachable.url, "k", metadata={"user_id": "x" * 5000})
        assert big.status_code == 413
        assert _error(big)["type"] == "request_too_large"
    finally:
        unreachable.stop()

    slow = StatestoreServer(
        database_url=migrated_pg_url,
        upstream_url=backend.url,
        redis_url=redis_url,
        redis_prefix=server_redis_prefix,
        env={"STATESTORE_UPSTREAM_READ_TIMEOUT": "0.5"},
    )
    try:
        backend.script({"kind": "echo", "delay_seconds": 2})
        response = _raw_create(slow.url, "k")
        assert response.status_code == 504
        assert _error(response)["type"] == "timeout_error"
    finally:
        slow.stop()


def test_health_readiness_and_metrics(pg_server: StatestoreServer, client: anthropic.Anthropic) -> None:
    assert httpx.get(f"{pg_server.url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{pg_server.url}/readyz")
    assert ready.status_code == 200
    assert ready.json()["database"] == "ok"
    assert ready.json()["cache_kind"] == "redis"
    client.messages.create(model="claude-test", max_tokens=10, messages=[{"role": "user", "content": "hi"}])
    metrics = httpx.get(f"{pg_server.url}/metrics").text
    assert 'http_requests_total{method="POST",route="/v1/messages",status="200"}' in metrics
    assert "upstream_request_duration_seconds" in metrics
