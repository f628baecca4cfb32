"""Owners (docs/protocol.md §7, §8; docs/guarantees.md invariants 4 and 5): one owner never sees, continues, lists,
deletes or takes over another's thread or session, in passthrough mode (the owner is a keyed hash of the client's own
credential) and in keys mode (statestore's own API keys, per tenant); keys mode refuses missing, wrong, revoked and
disabled keys and sends the backend the configured credential, never the client's; nothing is stored without opt-in.

Both modes run on a database of this module's own, so its tenants and threads meet no other module's."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import orjson
import pytest

from statestore.threads.ids import thread_of_response
from tests.support.admin_api import (
    ADMIN_TOKEN,
    ADMIN_TOKENS,
    MODEL,
    UPSTREAM_KEY,
    AdminApi,
    Api,
    Database,
    RedisKeys,
    created,
    error_of,
    json_of,
    passthrough_owner,
    said,
    start_server,
    unique,
    user,
)
from tests.support.fake_backend import FakeBackend, RecordedRequest
from tests.support.server import StatestoreServer

# The tenant whose backend credential is its own (STATESTORE_TENANT_UPSTREAM_KEYS is keyed by tenant name).
OWN_KEY_TENANT = "tenant-with-own-backend-key"
OWN_UPSTREAM_KEY = "sk-upstream-own-0123456789"


@pytest.fixture(scope="module")
def passthrough_server(
    module_db: str, redis_url: str, module_prefix: str, fake_backend_process: FakeBackend
) -> Iterator[StatestoreServer]:
    server = start_server(module_db, fake_backend_process.url, redis_url, module_prefix, {})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def keys_server(
    module_db: str, redis_url: str, module_prefix: str, fake_backend_process: FakeBackend
) -> Iterator[StatestoreServer]:
    server = start_server(
        module_db,
        fake_backend_process.url,
        redis_url,
        module_prefix,
        {
            "STATESTORE_AUTH_MODE": "keys",
            "STATESTORE_UPSTREAM_API_KEY": UPSTREAM_KEY,
            "STATESTORE_TENANT_UPSTREAM_KEYS": orjson.dumps({OWN_KEY_TENANT: OWN_UPSTREAM_KEY}).decode(),
            "STATESTORE_ADMIN_TOKENS": ADMIN_TOKENS,
            "STATESTORE_KEY_CACHE_SECONDS": "0",
        },
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def listed_keys_server(
    module_db: str, redis_url: str, module_prefix: str, fake_backend_process: FakeBackend
) -> Iterator[StatestoreServer]:
    """keys mode with backend credentials for named tenants only, and none for the others."""
    server = start_server(
        module_db,
        fake_backend_process.url,
        redis_url,
        module_prefix,
        {
            "STATESTORE_AUTH_MODE": "keys",
            "STATESTORE_TENANT_UPSTREAM_KEYS": orjson.dumps({OWN_KEY_TENANT: OWN_UPSTREAM_KEY}).decode(),
            "STATESTORE_ADMIN_TOKENS": ADMIN_TOKENS,
        },
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def admin(keys_server: StatestoreServer) -> Iterator[AdminApi]:
    with AdminApi(keys_server.url) as api:
        yield api


@pytest.fixture(scope="module")
def db(module_db: str) -> Database:
    return Database(module_db)


@pytest.fixture(scope="module")
def cache(redis_url: str, module_prefix: str) -> Iterator[RedisKeys]:
    keys = RedisKeys(redis_url, module_prefix)
    yield keys
    keys.close()


@dataclass
class TwoOwners:
    mode: str
    server: StatestoreServer
    key_a: str
    key_b: str


@pytest.fixture(params=["passthrough", "keys"])
def owners(request: pytest.FixtureRequest) -> TwoOwners:
    if request.param == "passthrough":
        server: StatestoreServer = request.getfixturevalue("passthrough_server")
        return TwoOwners("passthrough", server, f"sk-a-{secrets.token_hex(8)}", f"sk-b-{secrets.token_hex(8)}")
    server = request.getfixturevalue("keys_server")
    admin: AdminApi = request.getfixturevalue("admin")
    _, key_a = admin.tenant_with_key()
    _, key_b = admin.tenant_with_key()
    return TwoOwners("keys", server, key_a, key_b)


# == isolation (BOLA) on every route ===================================================================================


def test_another_owners_thread_is_404_on_every_route(
    owners: TwoOwners, backend: FakeBackend, db: Database, cache: RedisKeys, module_prefix: str
) -> None:
    with (
        anthropic.Anthropic(base_url=owners.server.url, api_key=owners.key_a, max_retries=0) as sdk_a,
        Api(owners.server.url, owners.key_a) as a,
        Api(owners.server.url, owners.key_b) as b,
    ):
        thread = sdk_a.beta.messages.thread(model=MODEL, max_tokens=64, system="Answer briefly.")
        reply = thread.send(user("what A said"))
        thread_id = thread_of_response(reply.id)
        assert thread_id is not None
        session_thread, session_head = created(a.session("shared-name", "A's session turn"))
        requests_before = len(backend.requests())

        # Continue: B gets thread_not_found for A's latest response id, for the session's one, with A's system too.
        error_of(b.continue_(reply.id, "B takes over"), 404, "not_found_error", "thread_not_found")
        error_of(b.continue_(session_head, "B again"), 404, "not_found_error", "thread_not_found")
        error_of(b.continue_(reply.id, "B again", system="Answer briefly."), 404, "not_found_error", "thread_not_found")
        # The thread API: 404, never 403, and the same answer as for a thread that does not exist.
        for path in (
            f"/statestore/v1/threads/{thread_id}",
            f"/statestore/v1/threads/{thread_id}/messages",
            f"/statestore/v1/threads/{session_thread}",
            f"/statestore/v1/threads/{session_thread}/messages",
            "/statestore/v1/sessions/shared-name",
        ):
            error_of(b.http.get(path), 404, "not_found_error")
        cached = cache.keys_of(thread_id)
        assert cached == [f"{module_prefix}{{{thread_id}}}:h", f"{module_prefix}{{{thread_id}}}:n"]
        error_of(b.delete(thread_id), 404, "not_found_error")
        error_of(b.delete(session_thread), 404, "not_found_error")
        # Not a byte of A's touched: rows and cache entries alike.
        assert db.rows_of(thread_id) == (1, 2, 0)
        assert db.rows_of(session_thread) == (1, 2, 1)
        assert cache.keys_of(thread_id) == cached
        # Lists: B's is empty; A's has both threads.
        assert json_of(b.threads()) == {"data": [], "has_more": False, "first_id": None, "last_id": None}
        assert json_of(b.threads(session_id="shared-name"))["data"] == []
        assert set(a.thread_ids()) == {thread_id, session_thread}
        # None of that reached the backend.
        assert len(backend.requests()) == requests_before

        # B's turn on the same session name makes B's own thread: the backend sees only B's message.
        b_thread, _ = created(b.session("shared-name", "B's session turn"))
        assert b_thread != session_thread
        assert backend.requests()[-1].json()["messages"] == [user("B's session turn")]
        assert json_of(b.session_info("shared-name"))["thread"]["id"] == b_thread
        a_session = json_of(a.session_info("shared-name"))["thread"]
        assert (a_session["id"], a_session["message_count"], a_session["head_message_id"]) == (
            session_thread,
            2,
            session_head,
        )
        # A's next session turn continues A's thread, untouched by B.
        assert created(a.session("shared-name", "A again"))[0] == session_thread
        assert backend.requests()[-1].json()["messages"] == [
            user("A's session turn"),
            said("A's session turn"),
            user("A again"),
        ]
        assert b.thread_ids() == [b_thread]

        # And A's own thread is still A's, whole, after every attempt of B's.
        assert json_of(a.thread(thread_id))["message_count"] == 2
        second = thread.send(user("A continues"))
        assert thread_of_response(second.id) == thread_id
        assert backend.requests()[-1].json()["messages"] == [
            user("what A said"),
            said("what A said"),
            user("A continues"),
        ]
        assert json_of(a.delete(thread_id))["type"] == "thread_deleted"


def test_passthrough_owner_follows_the_credential_not_its_header(
    passthrough_server: StatestoreServer, backend: FakeBackend
) -> None:
    """The same credential as `x-api-key` or as `Authorization: Bearer` is one owner; the backend judges it."""
    key = f"sk-c-{secrets.token_hex(8)}"
    with Api(passthrough_server.url, key) as by_header, Api(passthrough_server.url, key, bearer=True) as by_bearer:
        thread_id, head = created(by_header.create("hello"))
        assert by_bearer.thread_ids() == [thread_id]
        assert created(by_bearer.continue_(head, "again"))[0] == thread_id
        # Passthrough: the client's own credential goes to the backend.
        assert backend.requests()[-1].header("authorization") == f"Bearer {key}"


# == keys mode: credentials ===========================================================================================


def _tenant_routes(api: Api) -> dict[str, httpx.Response]:
    """One request on each route a tenant key opens."""
    return {
        "stateless": api.stateless("hello"),
        "stateless stream": api.stateless("hello", stream=True),
        "thread create": api.create("hello"),
        "thread continue": api.continue_("msg_" + "A" * 44, "hello"),
        "session": api.session("s-1", "hello"),
        "count_tokens": api.http.post(
            "/v1/messages/count_tokens",
            content=orjson.dumps({"model": MODEL, "messages": [user("hi")]}),
            headers={"content-type": "application/json"},
        ),
        "list threads": api.threads(),
        "get thread": api.thread("thr_" + "A" * 22),
        "session info": api.session_info("s-1"),
        "models": api.models(),
        "model": api.http.get(f"/v1/models/{MODEL}"),
    }


def _all_refused(api: Api) -> None:
    for route, response in _tenant_routes(api).items():
        assert response.status_code == 401, f"{route}: {response.status_code} {response.text}"
        error_of(response, 401, "authentication_error")


def test_keys_mode_refuses_missing_wrong_and_revoked_keys(
    keys_server: StatestoreServer, admin: AdminApi, backend: FakeBackend
) -> None:
    tenant, good = admin.tenant_with_key()
    revoked = admin.create_key(tenant["id"])
    assert json_of(admin.call("DELETE", f"/keys/{revoked['id']}"))["revoked_ms"] is not None
    wrong = "ssk_" + secrets.token_urlsafe(32)
    credentials: list[tuple[str | None, bool]] = [
        (None, False),
        (wrong, False),
        (wrong, True),
        (good[:-1], False),
        (revoked["secret"], False),
        (revoked["secret"], True),
        # Neither is a tenant credential: an admin token, and a backend key (passthrough's kind of credential).
        (ADMIN_TOKEN, True),
        (UPSTREAM_KEY, False),
    ]
    for credential, bearer in credentials:
        with Api(keys_server.url, credential, bearer=bearer) as api:
            _all_refused(api)
    assert backend.requests() == []
    # The good key of the same tenant opens every route.
    with Api(keys_server.url, good) as api:
        assert api.models().status_code == 200
        assert json_of(api.threads())["data"] == []
        created(api.create("hello"))


def test_keys_mode_disabled_tenant_is_refused_until_enabled(
    keys_server: StatestoreServer, admin: AdminApi, backend: FakeBackend
) -> None:
    tenant, key = admin.tenant_with_key()
    with Api(keys_server.url, key) as api:
        thread_id, head = created(api.create("before"))
        assert json_of(admin.call("POST", f"/tenants/{tenant['id']}/disable"))["disabled"] is True
        backend.reset()
        _all_refused(api)
        assert backend.requests() == []
        assert json_of(admin.call("POST", f"/tenants/{tenant['name']}/enable"))["disabled"] is False
        # Its threads were kept meanwhile, and continue where they stood.
        assert created(api.continue_(head, "after"))[0] == thread_id
        assert api.thread_ids() == [thread_id]


def _credential_headers(request: RecordedRequest) -> list[tuple[str, str]]:
    return [(name, value) for name, value in request.headers if name in ("x-api-key", "authorization")]


@pytest.fixture(scope="module")
def own_key_tenant(admin: AdminApi) -> dict[str, Any]:
    """The tenant STATESTORE_TENANT_UPSTREAM_KEYS names, made through the admin API."""
    return admin.create_tenant(OWN_KEY_TENANT)


@pytest.mark.parametrize("own_key", [pytest.param(False, id="global"), pytest.param(True, id="per-tenant")])
def test_keys_mode_backend_gets_the_configured_credential(
    keys_server: StatestoreServer, admin: AdminApi, backend: FakeBackend, request: pytest.FixtureRequest, own_key: bool
) -> None:
    tenant: dict[str, Any] = request.getfixturevalue("own_key_tenant") if own_key else admin.create_tenant()
    upstream_key = OWN_UPSTREAM_KEY if own_key else UPSTREAM_KEY
    secret = admin.create_key(tenant["id"])["secret"]
    for bearer in (False, True):
        backend.reset()
        with Api(keys_server.url, secret, bearer=bearer) as api:
            assert api.stateless("plain").status_code == 200
            assert api.stateless("plain stream", stream=True).status_code == 200
            _, head = created(api.create("threaded"))
            created(api.continue_(head, "threaded again", stream=True))
            created(api.session(unique("s"), "session"))
            assert api.models().status_code == 200
        with anthropic.Anthropic(base_url=keys_server.url, api_key=secret, max_retries=0) as sdk:
            thread = sdk.beta.messages.thread(model=MODEL, max_tokens=64)
            thread.send(user("sdk one"))
            thread.send(user("sdk two"))
        requests = backend.requests()
        assert len(requests) == 8
        for recorded in requests:
            assert _credential_headers(recorded) == [("x-api-key", upstream_key)], recorded.path
            assert secret not in orjson.dumps(recorded.headers).decode()
            assert secret.encode() not in recorded.body


def test_keys_mode_tenant_without_a_backend_credential_is_refused_never_forwarded(
    listed_keys_server: StatestoreServer, admin: AdminApi, backend: FakeBackend, own_key_tenant: dict[str, Any]
) -> None:
    """With STATESTORE_TENANT_UPSTREAM_KEYS and no STATESTORE_UPSTREAM_API_KEY, a tenant not listed has no backend
    credential: its requests are refused, rather than sent on with its statestore key."""
    _, unlisted = admin.tenant_with_key()
    listed = admin.create_key(own_key_tenant["id"])["secret"]
    with Api(listed_keys_server.url, unlisted) as api:
        for response in (api.stateless("hi"), api.create("hi"), api.session("s", "hi"), api.models(), api.threads()):
            assert "backend credential" in error_of(response, 403, "permission_error")["message"]
    assert backend.requests() == []
    with Api(listed_keys_server.url, listed) as api:
        created(api.create("hi"))
    [request] = backend.requests()
    assert _credential_headers(request) == [("x-api-key", OWN_UPSTREAM_KEY)]


# == opt-in ===========================================================================================================


def _stateless_traffic(api: Api) -> None:
    """Every kind of request that names no thread and no session."""
    assert api.stateless("plain").status_code == 200
    assert api.stateless("stream", stream=True).status_code == 200
    assert api.stateless("with a user", metadata={"user_id": "u-opt-in"}).status_code == 200
    # The threads beta alone opts in to nothing.
    body = {"model": MODEL, "max_tokens": 64, "messages": [user("beta only")]}
    assert api.post(body).status_code == 200
    assert api.post({**body, "stream": True}).status_code == 200
    count = api.http.post(
        "/v1/messages/count_tokens",
        content=orjson.dumps({"model": MODEL, "messages": [user("count")]}),
        headers={"content-type": "application/json"},
    )
    assert count.status_code == 200
    assert api.models().status_code == 200


def _nothing_threaded_forwarded(backend: FakeBackend) -> None:
    for request in backend.requests():
        if request.path == "/v1/messages":
            assert "thread" not in request.json()


def test_nothing_is_stored_without_opt_in_passthrough(
    passthrough_server: StatestoreServer, db: Database, backend: FakeBackend
) -> None:
    key = f"sk-optin-{secrets.token_hex(8)}"
    owner = passthrough_owner(key)
    with Api(passthrough_server.url, key) as api:
        _stateless_traffic(api)
        assert len(backend.requests()) == 7
        _nothing_threaded_forwarded(backend)
        assert api.thread_ids() == []
        assert db.value("SELECT count(*) FROM threads WHERE owner = $1", owner) == 0
        assert db.value("SELECT count(*) FROM sessions WHERE owner = $1", owner) == 0
        # The check above looks where a stored thread would be: one opt-in, and there it is.
        thread_id, _ = created(api.create("opt in"))
        assert db.value("SELECT id FROM threads WHERE owner = $1", owner) == thread_id


def test_nothing_is_stored_without_opt_in_keys(
    keys_server: StatestoreServer, admin: AdminApi, db: Database, backend: FakeBackend
) -> None:
    tenant, key = admin.tenant_with_key()
    with Api(keys_server.url, key) as api:
        _stateless_traffic(api)
        assert len(backend.requests()) == 7
        assert api.thread_ids() == []
        stats = admin.stats(tenant["id"])
        assert (stats["live_threads"], stats["live_messages"], stats["live_bytes"]) == (0, 0, 0)
        assert db.value("SELECT count(*) FROM threads WHERE tenant_id = $1", tenant["id"]) == 0
        thread_id, _ = created(api.session("opt-in", "opt in"))
        assert admin.stats(tenant["id"])["live_threads"] == 1
        assert db.value("SELECT id FROM threads WHERE tenant_id = $1", tenant["id"]) == thread_id
