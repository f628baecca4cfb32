"""One error path for an outage (docs/protocol.md §4): with the database gone, every route that needs it answers 503
with `retry-after`, in the error shape of its door, in both auth modes, the hot routes included.

Found by a review: in keys mode a key not yet cached is looked up in the database before anything else, and on
`POST /v1/messages` (threaded and relayed) that lookup ran outside the outage handling, so the request answered 500
where `/v1/responses` and the thread API answered 503. Each probe below uses a key the server has never seen, so
every one of them meets the database first.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator

import httpx
import orjson
import pytest

from statestore.store.migrate import upgrade
from tests.reliability.support import (
    MODEL,
    THREADS_BETA,
    PrivatePostgres,
    private_postgres,
    running_server,
    user,
    wait_for,
)
from tests.support.admin_api import ADMIN_TOKENS, UPSTREAM_KEY, AdminApi
from tests.support.fake_backend import FakeBackend

ENV = {"STATESTORE_DATABASE_TIMEOUT_SECONDS": "1.5", "STATESTORE_LEASE_SECONDS": "5"}
OPENAI_ERROR_FIELDS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def fake_backend() -> Iterator[FakeBackend]:
    with FakeBackend() as backend:
        yield backend


@pytest.fixture
def backend(fake_backend: FakeBackend) -> FakeBackend:
    fake_backend.reset()
    return fake_backend


@pytest.fixture
def outage_pg() -> Iterator[PrivatePostgres]:
    with private_postgres() as pg:
        upgrade(pg.url)
        yield pg


def anthropic_headers(key: str) -> dict[str, str]:
    return {
        "x-api-key": key,
        "anthropic-version": "2023-06-01",
        "anthropic-beta": THREADS_BETA,
        "content-type": "application/json",
    }


def bearer(key: str) -> dict[str, str]:
    """The key as OpenAI's SDK sends it."""
    headers = {k: v for k, v in anthropic_headers(key).items() if k != "x-api-key"}
    return {**headers, "authorization": f"Bearer {key}"}


def thread_body(text: str, previous_id: str | None = None) -> bytes:
    thread = {"type": "create"} if previous_id is None else {"type": "continue", "previous_message_id": previous_id}
    return orjson.dumps({"model": MODEL, "max_tokens": 64, "messages": [user(text)], "thread": thread})


def plain_body(text: str) -> bytes:
    return orjson.dumps({"model": MODEL, "max_tokens": 64, "messages": [user(text)]})


Probe = Callable[[httpx.Client, dict[str, str]], httpx.Response]


def probes(head: str, thread_id: str, response_id: str, conversation_id: str) -> dict[str, tuple[str, Probe]]:
    """name -> (the door's error shape, the request)."""
    return {
        "messages threaded create": (
            "anthropic",
            lambda h, a: h.post("/v1/messages", content=thread_body("c"), headers=a),
        ),
        "messages threaded continue": (
            "anthropic",
            lambda h, a: h.post("/v1/messages", content=thread_body("n", head), headers=a),
        ),
        "messages relayed": ("anthropic", lambda h, a: h.post("/v1/messages", content=plain_body("r"), headers=a)),
        "messages session": (
            "anthropic",
            lambda h, a: h.post(
                "/v1/messages", content=plain_body("s"), headers={**a, "statestore-session-id": "outage-session"}
            ),
        ),
        "count_tokens threaded": (
            "anthropic",
            lambda h, a: h.post("/v1/messages/count_tokens", content=thread_body("t", head), headers=a),
        ),
        "count_tokens relayed": (
            "anthropic",
            lambda h, a: h.post("/v1/messages/count_tokens", content=plain_body("t"), headers=a),
        ),
        "thread api": ("anthropic", lambda h, a: h.get(f"/statestore/v1/threads/{thread_id}", headers=a)),
        "thread api list": ("anthropic", lambda h, a: h.get("/statestore/v1/threads", headers=a)),
        "responses create": (
            "openai",
            lambda h, a: h.post("/v1/responses", json={"model": MODEL, "input": "x"}, headers=a),
        ),
        "responses chained": (
            "openai",
            lambda h, a: h.post(
                "/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": response_id}, headers=a
            ),
        ),
        "responses retrieve": ("openai", lambda h, a: h.get(f"/v1/responses/{response_id}", headers=a)),
        "conversations create": ("openai", lambda h, a: h.post("/v1/conversations", json={}, headers=a)),
        "conversations items": (
            "openai",
            lambda h, a: h.get(f"/v1/conversations/{conversation_id}/items", headers=a),
        ),
    }


def assert_outage(name: str, shape: str, response: httpx.Response) -> None:
    assert response.status_code == 503, (name, response.status_code, response.text)
    assert int(response.headers["retry-after"]) >= 1, (name, dict(response.headers))
    assert response.headers.get("request-id"), name
    assert "Traceback" not in response.text
    body = response.json()
    if shape == "openai":
        assert set(body["error"]) == OPENAI_ERROR_FIELDS and body["error"]["type"] == "server_error", (name, body)
    else:
        assert body["type"] == "error" and body["error"]["type"] == "api_error", (name, body)


def history(http: httpx.Client, key: str) -> tuple[str, str, str, str]:
    """A thread, a response and a conversation to probe, made while the database is up."""
    created = http.post("/v1/messages", content=thread_body("one"), headers=anthropic_headers(key))
    assert created.status_code == 200, created.text
    head = created.json()["id"]
    thread_id = http.get("/statestore/v1/threads", headers=anthropic_headers(key)).json()["data"][0]["id"]
    openai_auth = {"authorization": f"Bearer {key}"}
    response = http.post("/v1/responses", json={"model": MODEL, "input": "one"}, headers=openai_auth)
    assert response.status_code == 200, response.text
    conversation = http.post("/v1/conversations", json={}, headers=openai_auth)
    assert conversation.status_code == 200, conversation.text
    return head, thread_id, response.json()["id"], conversation.json()["id"]


@pytest.mark.parametrize("auth_mode", ["keys", "passthrough"])
def test_database_down_every_route_answers_503_with_retry_after(
    outage_pg: PrivatePostgres, backend: FakeBackend, auth_mode: str
) -> None:
    env = {**ENV, "STATESTORE_CHAT_UPSTREAM_URL": backend.url, "STATESTORE_ADMIN_TOKENS": ADMIN_TOKENS}
    if auth_mode == "keys":
        env |= {"STATESTORE_AUTH_MODE": "keys", "STATESTORE_UPSTREAM_API_KEY": UPSTREAM_KEY}
    with running_server(database_url=outage_pg.url, upstream_url=backend.url, env=env) as server:
        if auth_mode == "keys":
            with AdminApi(server.url) as admin:
                tenant, used = admin.tenant_with_key()
                # Never presented before the outage: the server has not cached it.
                fresh = admin.create_key(tenant["id"])["secret"]
        else:
            used = fresh = f"sk-outage-{secrets.token_hex(8)}"
        with httpx.Client(base_url=server.url, timeout=15) as http:
            head, thread_id, response_id, conversation_id = history(http, used)
            outage_pg.crash()
            try:
                seen = {}
                for _ in range(2):  # the pool's dead connections first, then refused connects
                    for name, (shape, call) in probes(head, thread_id, response_id, conversation_id).items():
                        for auth in (anthropic_headers(fresh), bearer(fresh)):
                            response = call(http, auth)
                            if auth_mode == "passthrough" and name in ("messages relayed", "count_tokens relayed"):
                                # A stateless relay in passthrough mode needs no database: it is served.
                                assert response.status_code == 200, (name, response.text)
                                continue
                            assert_outage(name, shape, response)
                            seen[name] = response.status_code
            finally:
                outage_pg.start()
            assert seen, "nothing was probed"
            # Served again once the database is back.
            wait_for(
                lambda: (
                    http.post(
                        "/v1/messages", content=thread_body("two", head), headers=anthropic_headers(fresh)
                    ).status_code
                    == 200
                ),
                within=10,
                what="threaded turns served again",
            )
