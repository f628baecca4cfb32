"""Counting the tokens a threaded turn would send (docs/protocol.md §11): `POST /v1/messages/count_tokens` with a
`thread` field or a session header, through the official SDK against real server processes, on PostgreSQL + Redis and on
SQLite.

The fake backend's `count_tokens` counts as its usage does (a token per 4 bytes of the JSON of system, tools and
messages), so each count is held to the `input_tokens` of the very turn it counted; where the backend has no
`count_tokens`, statestore's estimate answers, and a header says which."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import orjson
import pytest
from anthropic.types.beta import BetaMessageParam

from tests.integration.test_threads import MODEL, SYSTEM, THREADS_BETA, WEATHER_TOOL, said, user
from tests.support.admin_api import ADMIN_TOKENS, UPSTREAM_KEY, AdminApi, start_server
from tests.support.fake_backend import FakeBackend, RecordedRequest, error_action
from tests.support.server import StatestoreServer

COUNT_PATH = "/v1/messages/count_tokens"
BETAS: Any = [THREADS_BETA]


def continuing(previous_id: str) -> dict[str, Any]:
    return {"thread": {"type": "continue", "previous_message_id": previous_id}}


def counted(
    client: anthropic.Anthropic, messages: list[BetaMessageParam], *, thread: Any = None, **options: Any
) -> tuple[int, str | None]:
    """(input_tokens, the statestore-token-count header) of a count through the SDK."""
    extra = {"thread": thread} if thread is not None else None
    raw = client.beta.messages.with_raw_response.count_tokens(
        model=MODEL, messages=messages, betas=BETAS, extra_body=extra, **options
    )
    return raw.parse().input_tokens, raw.headers.get("statestore-token-count")


def count_requests(backend: FakeBackend) -> list[RecordedRequest]:
    return [request for request in backend.requests() if request.path == COUNT_PATH]


def error_code(error: anthropic.APIStatusError) -> str:
    body: Any = error.body
    return str(body["error"]["details"]["error_code"])


def create(client: anthropic.Anthropic, text: str, **fields: Any) -> Any:
    return client.beta.messages.create(
        model=MODEL, max_tokens=64, messages=[user(text)], thread={"type": "create"}, betas=BETAS, **fields
    )


def continue_(client: anthropic.Anthropic, previous_id: str, text: str, **fields: Any) -> Any:
    return client.beta.messages.create(
        model=MODEL,
        max_tokens=64,
        messages=[user(text)],
        thread={"type": "continue", "previous_message_id": previous_id},
        betas=BETAS,
        **fields,
    )


# == a backend that counts (the shared fake's count_tokens), both storage set-ups =====================================


def test_a_count_over_a_thread_is_the_input_of_the_continue_it_counts(
    server_client: anthropic.Anthropic, backend: FakeBackend
) -> None:
    first = create(server_client, "one", system=SYSTEM, tools=[WEATHER_TOOL])
    second = continue_(server_client, first.id, "two")
    tokens, source = counted(server_client, [user("three")], thread=continuing(second.id)["thread"])
    assert source == "backend"
    [request] = count_requests(backend)
    # The backend counted the request the continue sends: stored system, tools and messages, then the new ones; no
    # thread field and no threads beta.
    assert request.json() == {
        "model": MODEL,
        "system": SYSTEM,
        "tools": [WEATHER_TOOL],
        "messages": [user("one"), said(first), user("two"), said(second), user("three")],
    }
    assert THREADS_BETA not in (request.header("anthropic-beta") or "")
    assert not [name for name, _ in request.headers if name.startswith("statestore-")]
    third = continue_(server_client, second.id, "three")
    assert third.usage.input_tokens == tokens
    # The count held nothing and stored nothing: the id it counted from was continued, once.
    assert third.id != second.id
    with pytest.raises(anthropic.BadRequestError) as late:
        counted(server_client, [user("four")], thread=continuing(second.id)["thread"])
    assert error_code(late.value) == "thread_already_continued"


def test_a_count_on_a_session_counts_its_live_thread_or_the_create_it_would_be(
    server_client: anthropic.Anthropic, backend: FakeBackend
) -> None:
    session = {"statestore-session-id": f"count-{secrets.token_hex(4)}"}
    fresh, source = counted(server_client, [user("hello")], extra_headers=session)
    assert source == "backend"
    started = server_client.beta.messages.create(
        model=MODEL, max_tokens=64, messages=[user("hello")], extra_headers=session
    )
    assert started.usage.input_tokens == fresh
    more, _ = counted(server_client, [user("and more")], extra_headers=session)
    assert more > fresh
    [_, request] = count_requests(backend)
    assert request.json()["messages"] == [user("hello"), said(started.to_dict()), user("and more")]
    went_on = server_client.beta.messages.create(
        model=MODEL, max_tokens=64, messages=[user("and more")], extra_headers=session
    )
    assert went_on.usage.input_tokens == more


def test_a_count_of_a_create_is_the_create_s_input_and_stores_nothing(
    server_client: anthropic.Anthropic, server: StatestoreServer, api_key: str, backend: FakeBackend
) -> None:
    tokens, source = counted(server_client, [user("brand new")], thread={"type": "create"}, system=SYSTEM)
    assert source == "backend"
    assert "thread" not in count_requests(backend)[0].json()
    listed = httpx.get(server.url + "/statestore/v1/threads", headers={"x-api-key": api_key}).json()
    assert listed["data"] == []
    assert create(server_client, "brand new", system=SYSTEM).usage.input_tokens == tokens


def test_a_count_is_refused_as_the_continue_would_be(
    server_client: anthropic.Anthropic, server: StatestoreServer, backend: FakeBackend
) -> None:
    first = create(server_client, "mine", system=SYSTEM)
    second = continue_(server_client, first.id, "still mine")
    refusals: list[tuple[type[anthropic.APIStatusError], str, Any, dict[str, Any]]] = [
        (anthropic.NotFoundError, "thread_not_found", continuing("msg_" + "A" * 44), {}),
        (anthropic.NotFoundError, "thread_not_found", continuing(second.id[:-1]), {}),
        (anthropic.BadRequestError, "thread_already_continued", continuing(first.id), {}),
        (anthropic.BadRequestError, "thread_fingerprint_mismatch", continuing(second.id), {"system": "other"}),
    ]
    for kind, code, body, fields in refusals:
        with pytest.raises(kind) as refused:
            counted(server_client, [user("x")], thread=body["thread"], **fields)
        assert error_code(refused.value) == code
        assert refused.value.response.headers["x-should-retry"] == "false"
    # Another owner's thread is not found, never counted.
    with anthropic.Anthropic(base_url=server.url, api_key=f"sk-other-{secrets.token_hex(6)}", max_retries=0) as other:
        with pytest.raises(anthropic.NotFoundError) as hidden:
            counted(other, [user("peek")], thread=continuing(second.id)["thread"])
        assert error_code(hidden.value) == "thread_not_found"
    # Without the threads beta, a thread field is refused as on /v1/messages.
    with pytest.raises(anthropic.BadRequestError):
        server_client.beta.messages.count_tokens(model=MODEL, messages=[user("x")], extra_body=continuing(second.id))
    assert count_requests(backend) == []


def test_threads_turned_off_refuse_a_count_over_a_thread(
    threads_off_server: StatestoreServer, api_key: str, backend: FakeBackend
) -> None:
    with anthropic.Anthropic(base_url=threads_off_server.url, api_key=api_key, max_retries=0) as client:
        with pytest.raises(anthropic.BadRequestError) as refused:
            counted(client, [user("x")], thread={"type": "create"})
        assert error_code(refused.value) == "thread_unsupported_request"
        # Without a thread, a count is the relay it always was.
        assert client.beta.messages.count_tokens(model=MODEL, messages=[user("x")]).input_tokens > 0
    assert len(count_requests(backend)) == 1


def test_a_count_never_waits_for_a_continue_in_flight(server_client: anthropic.Anthropic, backend: FakeBackend) -> None:
    first = create(server_client, "before")
    backend.script({"kind": "echo", "delay_seconds": 1.5})
    replies: list[Any] = []
    running = threading.Thread(target=lambda: replies.append(continue_(server_client, first.id, "slow")))
    running.start()
    try:
        while not [r for r in backend.requests() if r.path == "/v1/messages" and b"slow" in r.body]:
            threading.Event().wait(0.02)
        # The continue holds the head; a count reads past it, and counts the thread as it stands.
        tokens, source = counted(server_client, [user("slow")], thread=continuing(first.id)["thread"])
        assert source == "backend"
        assert not replies
    finally:
        running.join()
    [reply] = replies
    assert reply.usage.input_tokens == tokens


def test_the_backend_s_refusal_of_a_count_is_relayed_as_it_came(
    server_client: anthropic.Anthropic, backend: FakeBackend
) -> None:
    first = create(server_client, "hello")
    thread = continuing(first.id)["thread"]
    backend.script(
        {**error_action(529, "overloaded_error", "Overloaded", headers={"retry-after": "7"}), "path": COUNT_PATH}
    )
    with pytest.raises(anthropic.APIStatusError) as overloaded:
        counted(server_client, [user("x")], thread=thread)
    assert overloaded.value.status_code == 529
    assert overloaded.value.response.headers["retry-after"] == "7"
    assert "statestore-token-count" not in overloaded.value.response.headers
    # A 404 in the API's own words (an unknown model) is the backend judging the request, not a missing route: the
    # next count goes to the backend again.
    backend.script({**error_action(404, "not_found_error", "model: claude-nope"), "path": COUNT_PATH})
    with pytest.raises(anthropic.NotFoundError) as unknown:
        counted(server_client, [user("x")], thread=thread)
    assert "claude-nope" in unknown.value.message
    assert counted(server_client, [user("x")], thread=thread)[1] == "backend"
    assert len(count_requests(backend)) == 3


# == keys mode, and the owner's context policy =========================================================================


@pytest.fixture(scope="module")
def keys_server(
    module_db: str, redis_url: str, module_prefix: str, fake_backend_process: FakeBackend
) -> Iterator[StatestoreServer]:
    env = {
        "STATESTORE_AUTH_MODE": "keys",
        "STATESTORE_UPSTREAM_API_KEY": UPSTREAM_KEY,
        "STATESTORE_ADMIN_TOKENS": ADMIN_TOKENS,
        "STATESTORE_KEY_CACHE_SECONDS": "0",
        "STATESTORE_POLICY_CACHE_SECONDS": "0",
    }
    server = start_server(module_db, fake_backend_process.url, redis_url, module_prefix, env)
    yield server
    server.stop()


def test_a_count_after_the_context_policy_is_what_the_truncated_turn_sends(
    keys_server: StatestoreServer, backend: FakeBackend
) -> None:
    with AdminApi(keys_server.url) as admin:
        tenant, key = admin.tenant_with_key()
        admin.put_policy(tenant["id"], context_strategy="truncate", context_window_tokens=1024)
    words = "word " * 200  # about 250 tokens a message; a reply, 64
    with anthropic.Anthropic(base_url=keys_server.url, api_key=key, max_retries=0) as client:
        head = continue_(client, create(client, f"0 {words}").id, f"1 {words}")
        tokens, source = counted(client, [user(f"2 {words}")], thread=continuing(head.id)["thread"])
        assert source == "backend"
        request = count_requests(backend)[-1]
        # The backend got the deployment's credential, as the turn's request does, not the tenant's key.
        assert request.header("x-api-key") == UPSTREAM_KEY
        # Past the trigger (0.8 of 1,024 tokens): the base moved to a later user turn, as the turn's will.
        sent = request.json()["messages"]
        assert sent[0] != user(f"0 {words}")
        assert sent[-1] == user(f"2 {words}")
        raw = client.beta.messages.with_raw_response.create(
            model=MODEL, max_tokens=64, messages=[user(f"2 {words}")], betas=BETAS, extra_body=continuing(head.id)
        )
        assert raw.headers["statestore-context"] == "truncated"
        assert raw.parse().usage.input_tokens == tokens
        turn_request = [r for r in backend.requests() if r.path == "/v1/messages"][-1]
        assert turn_request.json()["messages"][:-1] == sent[:-1]


# == a backend without count_tokens: the estimate ======================================================================


@pytest.fixture(scope="module")
def no_counter_backend() -> Iterator[FakeBackend]:
    with FakeBackend(count_tokens=False) as backend:
        yield backend


@pytest.fixture(scope="module")
def estimating_server(
    module_db: str, redis_url: str, module_prefix: str, no_counter_backend: FakeBackend
) -> Iterator[StatestoreServer]:
    server = start_server(module_db, no_counter_backend.url, redis_url, module_prefix, {})
    yield server
    server.stop()


def test_without_a_backend_count_the_estimate_answers_and_the_backend_is_not_asked_again(
    estimating_server: StatestoreServer, no_counter_backend: FakeBackend, api_key: str
) -> None:
    backend = no_counter_backend
    backend.reset()
    with anthropic.Anthropic(base_url=estimating_server.url, api_key=api_key, max_retries=0) as client:
        first = create(client, "estimate " * 100)
        second = continue_(client, first.id, "a second turn " * 50)
        estimates = []
        for text in ("short", "a longer question " * 40):
            tokens, source = counted(client, [user(text)], thread=continuing(second.id)["thread"])
            assert source == "estimate"
            estimates.append(tokens)
        assert estimates[1] > estimates[0]
        # Asked once, found without the route, and remembered.
        assert len([r for r in backend.requests() if r.path == COUNT_PATH]) == 1
        third = continue_(client, second.id, "a longer question " * 40)
        # The estimate reckons with the thread's own tokens per byte, measured by the backend's usage.
        assert abs(estimates[1] - third.usage.input_tokens) <= 0.1 * third.usage.input_tokens
        # Without a thread the count stays a relay: the backend's own 404.
        plain = httpx.post(
            estimating_server.url + COUNT_PATH,
            content=orjson.dumps({"model": MODEL, "messages": [user("plain")]}),
            headers={"x-api-key": api_key, "content-type": "application/json"},
        )
        assert plain.status_code == 404
        assert plain.json() == {"detail": "Not Found"}
