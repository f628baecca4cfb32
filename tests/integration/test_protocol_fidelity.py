"""What an unmodified official SDK does that statestore must get right (docs/protocol.md §1, §2, §7, §10): `thread:
null`, statestore's own routes out of `/v1` (every other `/v1` path relayed, the Managed Agents API included), cache
diagnostics through threads, and usage totals in thread metadata."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import orjson
import pytest
from anthropic.types import MessageParam

from tests.integration.test_threads import MODEL, THREADS_BETA, echo, forwarded, minted, said, user
from tests.support.fake_backend import FakeBackend, RecordedRequest, message_action
from tests.support.server import StatestoreServer

AGENTS_BETA = "managed-agents-2026-04-01"


def plain(text: str) -> MessageParam:
    """A user turn for the non-beta client calls."""
    return {"role": "user", "content": text}


def owner_get(server: StatestoreServer, api_key: str, path: str) -> httpx.Response:
    return httpx.get(f"{server.url}{path}", headers={"x-api-key": api_key}, timeout=10)


def thread_count(server: StatestoreServer, api_key: str) -> int:
    listed = owner_get(server, api_key, "/statestore/v1/threads")
    assert listed.status_code == 200, listed.text
    return len(listed.json()["data"])


# == thread: null (docs/protocol.md §2)
# ======================================================================================


def test_thread_null_is_a_plain_request(
    server: StatestoreServer, server_client: anthropic.Anthropic, api_key: str, backend: FakeBackend
) -> None:
    reply = server_client.beta.messages.create(
        model=MODEL, max_tokens=64, messages=[user("stateless")], thread=None, betas=[THREADS_BETA]
    )

    assert reply.to_dict()["content"] == echo("stateless")
    assert thread_of_nothing(reply.id)
    body = forwarded(backend, rebuilt=False)
    assert body == {"max_tokens": 64, "messages": [user("stateless")], "model": MODEL}
    assert thread_count(server, api_key) == 0


def thread_of_nothing(message_id: str) -> bool:
    """The id is the backend's own: the request was relayed, not threaded."""
    from statestore.threads.ids import thread_of_response

    return thread_of_response(message_id) is None


def test_thread_null_without_the_beta_header_is_accepted(
    server_client: anthropic.Anthropic, backend: FakeBackend
) -> None:
    reply = server_client.messages.create(
        model=MODEL, max_tokens=64, messages=[plain("plain")], extra_body={"thread": None}
    )
    assert reply.to_dict()["content"] == echo("plain")
    assert "thread" not in forwarded(backend, rebuilt=False)


def test_thread_null_on_count_tokens(server_client: anthropic.Anthropic, backend: FakeBackend) -> None:
    counted = server_client.messages.count_tokens(
        model=MODEL, messages=[plain("count me")], extra_body={"thread": None}
    )
    assert counted.input_tokens > 0
    [request] = backend.requests()
    assert request.path == "/v1/messages/count_tokens"
    assert "thread" not in request.json()


def test_thread_object_on_count_tokens_needs_the_threads_beta(
    server_client: anthropic.Anthropic, backend: FakeBackend
) -> None:
    """As on /v1/messages (docs/protocol.md §2): a count over a thread is counted (test_thread_token_counts.py)."""
    with pytest.raises(anthropic.BadRequestError) as refused:
        server_client.messages.count_tokens(
            model=MODEL, messages=[plain("count me")], extra_body={"thread": {"type": "create"}}
        )
    assert "message-threads-2026-08-12" in refused.value.message
    assert backend.requests() == []


def test_thread_null_with_a_session_header_is_a_session_turn(
    server: StatestoreServer, server_client: anthropic.Anthropic, api_key: str, backend: FakeBackend
) -> None:
    headers = {"statestore-session-id": "null-thread-session"}
    first = server_client.beta.messages.with_raw_response.create(
        model=MODEL, max_tokens=64, messages=[user("one")], thread=None, extra_headers=headers
    )
    second = server_client.beta.messages.create(
        model=MODEL, max_tokens=64, messages=[user("two")], thread=None, extra_headers=headers
    )

    assert first.headers["statestore-session-id"] == "null-thread-session"
    assert minted(first.parse().id) == minted(second.id)
    assert forwarded(backend)["messages"] == [user("one"), said(first.parse()), user("two")]
    assert thread_count(server, api_key) == 1


# == routes: /v1 belongs to the Messages API (docs/protocol.md §1, §7) =================================================


def _session_object(session_id: str) -> dict[str, Any]:
    return {"id": session_id, "type": "session", "status": "idle", "created_at": "2026-11-30T00:00:00Z"}


def _raw_reply(path: str, method: str, payload: object) -> dict[str, Any]:
    return {
        "kind": "raw",
        "path": path,
        "method": method,
        "status": 200,
        "headers": {"content-type": "application/json"},
        "chunks": [orjson.dumps(payload).decode()],
    }


def _agents_calls(client: anthropic.Anthropic) -> list[str]:
    """The Managed Agents API's session calls; returns the ids the SDK parsed from each reply."""
    created = client.beta.sessions.create(agent="agent_1", environment_id="env_1", title="through statestore")
    retrieved = client.beta.sessions.retrieve("sesn_abc")
    listed = client.beta.sessions.list(limit=2)
    return [created.id, retrieved.id, *[session.id for session in listed.data]]


def _script_agents(backend: FakeBackend) -> None:
    backend.script(
        _raw_reply("/v1/sessions", "POST", _session_object("sesn_new")),
        _raw_reply("/v1/sessions/sesn_abc", "GET", _session_object("sesn_abc")),
        _raw_reply(
            "/v1/sessions",
            "GET",
            {"data": [_session_object("sesn_1"), _session_object("sesn_2")], "next_page": None},
        ),
    )


def _comparable(request: RecordedRequest) -> tuple[str, str, str, bytes, list[tuple[str, str]]]:
    hop = {"host", "content-length", "connection", "x-stainless-retry-count", "x-stainless-read-timeout"}
    headers = sorted((name, value) for name, value in request.headers if name not in hop)
    return request.method, request.raw_path, request.query, request.body, headers


def test_managed_agents_sessions_are_relayed_byte_for_byte(pg_server: StatestoreServer, backend: FakeBackend) -> None:
    """`client.beta.sessions` create, retrieve and list reach the backend through statestore exactly as they do when
    the SDK calls the backend itself."""
    options: dict[str, Any] = {"api_key": "sk-agents-test", "max_retries": 0, "default_headers": {"x-trace": "t1"}}
    _script_agents(backend)
    with anthropic.Anthropic(base_url=backend.url, **options) as direct:
        direct_ids = _agents_calls(direct)
    direct_requests = backend.requests()
    backend.reset()

    _script_agents(backend)
    with anthropic.Anthropic(base_url=pg_server.url, **options) as relayed:
        relayed_ids = _agents_calls(relayed)
    relayed_requests = backend.requests()

    assert relayed_ids == direct_ids == ["sesn_new", "sesn_abc", "sesn_1", "sesn_2"]
    assert [r.path for r in relayed_requests] == ["/v1/sessions", "/v1/sessions/sesn_abc", "/v1/sessions"]
    assert AGENTS_BETA in (relayed_requests[0].header("anthropic-beta") or "")
    assert [_comparable(r) for r in relayed_requests] == [_comparable(r) for r in direct_requests]


@pytest.mark.parametrize("method", ["GET", "POST", "PUT", "PATCH", "DELETE"])
def test_any_other_v1_path_is_relayed(pg_server: StatestoreServer, backend: FakeBackend, method: str) -> None:
    # Paths statestore's own API used to hold are the backend's now, whatever the method.
    response = httpx.request(
        method,
        f"{pg_server.url}/v1/sessions/sesn_x/threads?limit=1",
        headers={"x-api-key": "sk-any", "content-type": "application/json"},
        content=b"{}" if method in {"POST", "PUT", "PATCH"} else None,
        timeout=10,
    )
    [request] = backend.requests()
    assert (request.method, request.path, request.query) == (method, "/v1/sessions/sesn_x/threads", "limit=1")
    # The fake backend has no such route: its own 404 comes back, as from the backend itself.
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"
    assert response.headers["request-id"].startswith("req_")


def test_thread_api_lives_under_statestore(
    pg_server: StatestoreServer, client: anthropic.Anthropic, api_key: str, backend: FakeBackend
) -> None:
    reply = client.beta.messages.create(
        model=MODEL,
        max_tokens=64,
        messages=[user("where am I")],
        thread={"type": "create"},
        betas=[THREADS_BETA],
        extra_headers={"statestore-session-id": "routes-session"},
    )
    thread_id = minted(reply.id)

    assert owner_get(pg_server, api_key, f"/statestore/v1/threads/{thread_id}").json()["id"] == thread_id
    session = owner_get(pg_server, api_key, "/statestore/v1/sessions/routes-session").json()
    assert session["thread"]["id"] == thread_id
    backend.reset()
    # The old paths are the backend's: statestore answers nothing there itself.
    old = owner_get(pg_server, api_key, f"/v1/threads/{thread_id}")
    assert old.status_code == 404
    [request] = backend.requests()
    assert request.path == f"/v1/threads/{thread_id}"


def test_openapi_document_lists_the_new_paths(pg_server: StatestoreServer) -> None:
    paths = httpx.get(f"{pg_server.url}/openapi.json", timeout=10).json()["paths"]
    assert "/statestore/v1/threads" in paths
    assert "/statestore/v1/threads/{thread_id}/messages" in paths
    assert "/statestore/v1/sessions/{session_id}" in paths
    assert not [path for path in paths if path.startswith(("/v1/threads", "/v1/sessions"))]


# == cache diagnostics (docs/protocol.md §10) ==========================================================================


@pytest.fixture
def second_client(pg_server: StatestoreServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=pg_server.url, api_key="sk-test-another-owner", max_retries=0) as sdk:
        yield sdk


def _diagnostics_sent(backend: FakeBackend) -> Any:
    return forwarded(backend, rebuilt=False).get("diagnostics")


def test_thread_diagnostics_name_the_backends_id(server_client: anthropic.Anthropic, backend: FakeBackend) -> None:
    backend.script(
        message_action(echo("one"), id="msg_backend_one"),
        message_action(echo("two"), id="msg_backend_two"),
        message_action(echo("three"), id="msg_backend_three"),
    )
    thread = server_client.beta.messages.thread(model=MODEL, max_tokens=64)
    first = thread.send(user("one"), diagnostics={"previous_message_id": None})
    assert _diagnostics_sent(backend) == {"previous_message_id": None}

    second = thread.send(user("two"), diagnostics={"previous_message_id": first.id})
    assert _diagnostics_sent(backend) == {"previous_message_id": "msg_backend_one"}

    # Any earlier reply of the thread, not only the latest.
    thread.send(user("three"), diagnostics={"previous_message_id": first.id})
    assert _diagnostics_sent(backend) == {"previous_message_id": "msg_backend_one"}
    assert second.id != first.id


def test_streamed_reply_keeps_its_backend_id_and_diagnostics(
    server_client: anthropic.Anthropic, backend: FakeBackend
) -> None:
    verdict = {"cache_miss_reason": {"type": "messages_changed", "messages_index": 1}}
    backend.script(
        message_action(echo("one"), id="msg_backend_streamed"),
        message_action(echo("two"), id="msg_backend_next", diagnostics=verdict),
    )
    thread = server_client.beta.messages.thread(model=MODEL, max_tokens=64)
    with thread.stream(user("one")) as stream:
        first = stream.get_final_message()
    with thread.stream(user("two"), diagnostics={"previous_message_id": first.id}) as stream:
        second = stream.get_final_message()

    assert forwarded(backend)["diagnostics"] == {"previous_message_id": "msg_backend_streamed"}
    # The backend's verdict arrives in message_start and reaches the client as it was.
    assert second.to_dict()["diagnostics"] == verdict
    minted(second.id, not_="msg_backend_next")


def test_relayed_request_diagnostics_are_rewritten_for_the_owner_only(
    client: anthropic.Anthropic, second_client: anthropic.Anthropic, backend: FakeBackend
) -> None:
    backend.script(message_action(echo("one"), id="msg_backend_relay"))
    threaded = client.beta.messages.create(
        model=MODEL, max_tokens=64, messages=[user("one")], thread={"type": "create"}, betas=[THREADS_BETA]
    )

    client.messages.create(
        model=MODEL,
        max_tokens=64,
        messages=[plain("x")],
        extra_body={"diagnostics": {"previous_message_id": threaded.id}},
    )
    assert _diagnostics_sent(backend) == {"previous_message_id": "msg_backend_relay"}

    # Another owner naming it: passed through untouched (the backend will not know it).
    second_client.messages.create(
        model=MODEL,
        max_tokens=64,
        messages=[plain("x")],
        extra_body={"diagnostics": {"previous_message_id": threaded.id}},
    )
    assert _diagnostics_sent(backend) == {"previous_message_id": threaded.id}


def test_ids_statestore_did_not_mint_pass_through_byte_for_byte(
    pg_server: StatestoreServer, api_key: str, backend: FakeBackend
) -> None:
    body = (
        b'{"model": "claude-test", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}],'
        b' "diagnostics": {"previous_message_id": "msg_01AbCdEfGhIjKlMnOpQrStUv"}}'
    )
    response = httpx.post(
        f"{pg_server.url}/v1/messages",
        content=body,
        headers={"x-api-key": api_key, "content-type": "application/json", "anthropic-version": "2023-06-01"},
        timeout=10,
    )
    assert response.status_code == 200
    [request] = backend.requests()
    assert request.body == body


# == usage totals (docs/protocol.md §10) ===============================================================================


def _usage(input_tokens: int, output_tokens: int, created: int, read: int) -> dict[str, int]:
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": created,
        "cache_read_input_tokens": read,
    }


def test_thread_metadata_adds_up_usage(
    server: StatestoreServer, server_client: anthropic.Anthropic, api_key: str, backend: FakeBackend
) -> None:
    backend.script(
        message_action(echo("one"), usage=_usage(100, 10, 80, 0)),
        message_action(echo("two"), usage=_usage(20, 7, 5, 80)),
        message_action(echo("three"), usage=_usage(30, 3, 0, 85)),
    )
    thread = server_client.beta.messages.thread(model=MODEL, max_tokens=64)
    thread.send(user("one"))
    with thread.stream(user("two")) as stream:
        stream.get_final_message()
    last = thread.send(user("three"))

    info = owner_get(server, api_key, f"/statestore/v1/threads/{minted(last.id)}").json()
    assert info["usage"] == {
        "input_tokens": 150,
        "output_tokens": 20,
        "cache_creation_input_tokens": 85,
        "cache_read_input_tokens": 165,
        "turns": 3,
    }
    assert info["turn_count"] == 3


def test_turns_that_are_not_stored_add_no_usage(
    server: StatestoreServer, server_client: anthropic.Anthropic, api_key: str, backend: FakeBackend
) -> None:
    backend.script(
        message_action(echo("one"), usage=_usage(10, 1, 0, 0)),
        message_action(echo("no"), usage=_usage(1000, 1000, 0, 0), stop_reason="refusal"),
        {"kind": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}},
        message_action(echo("two"), usage={"input_tokens": 5, "output_tokens": 2, "cache_read_input_tokens": None}),
    )
    thread = server_client.beta.messages.thread(model=MODEL, max_tokens=64)
    first = thread.send(user("one"))
    # A refusal is returned, not stored; the SDK then replays the thread, a new one (docs/protocol.md §2).
    raw = anthropic.Anthropic(base_url=server.url, api_key=api_key, max_retries=0)
    refused = raw.beta.messages.create(
        model=MODEL,
        max_tokens=64,
        messages=[user("no")],
        thread={"type": "continue", "previous_message_id": first.id},
        betas=[THREADS_BETA],
    )
    assert refused.stop_reason == "refusal"
    with pytest.raises(anthropic.APIStatusError):
        raw.beta.messages.create(
            model=MODEL,
            max_tokens=64,
            messages=[user("err")],
            thread={"type": "continue", "previous_message_id": first.id},
            betas=[THREADS_BETA],
        )
    second = raw.beta.messages.create(
        model=MODEL,
        max_tokens=64,
        messages=[user("two")],
        thread={"type": "continue", "previous_message_id": first.id},
        betas=[THREADS_BETA],
    )
    raw.close()

    info = owner_get(server, api_key, f"/statestore/v1/threads/{minted(second.id)}").json()
    assert info["usage"] == {
        "input_tokens": 15,
        "output_tokens": 3,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "turns": 2,
    }
