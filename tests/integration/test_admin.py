"""Administration (docs/protocol.md §5, §8): retention policies (validation, per-tenant overrides, TTL clamping, limits,
threads and sessions switched off), the audit log, who may call `/admin/v1`, and the `statestore admin …` CLI round
trips.

Its servers run on a database of this module's own: the tests change the default policy, which would reach every
other module's threads on the shared one. Policies are cleared after each test."""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import orjson
import pytest

from statestore.threads.ids import thread_of_response
from tests.support.admin_api import (
    ADMIN_TOKEN,
    ADMIN_TOKENS,
    AUDITOR_TOKEN,
    MODEL,
    UPSTREAM_KEY,
    AdminApi,
    Api,
    Database,
    assert_about,
    cli,
    cli_env,
    cli_fails,
    cli_json,
    cli_many,
    cli_ok,
    created,
    error_of,
    granted_ttl,
    json_of,
    policy,
    rfc3339,
    said,
    start_server,
    unique,
    user,
)
from tests.support.fake_backend import FakeBackend
from tests.support.server import StatestoreServer


@pytest.fixture(scope="module")
def keys_server(
    module_db: str, redis_url: str, module_prefix: str, fake_backend_process: FakeBackend
) -> Iterator[StatestoreServer]:
    """keys mode; keys and policies are read from the database on every request, so a change made by another
    process (the CLI) applies at once."""
    server = start_server(
        module_db,
        fake_backend_process.url,
        redis_url,
        module_prefix,
        {
            "STATESTORE_AUTH_MODE": "keys",
            "STATESTORE_UPSTREAM_API_KEY": UPSTREAM_KEY,
            "STATESTORE_ADMIN_TOKENS": ADMIN_TOKENS,
            "STATESTORE_KEY_CACHE_SECONDS": "0",
            "STATESTORE_POLICY_CACHE_SECONDS": "0",
        },
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def passthrough_server(
    module_db: str, redis_url: str, module_prefix: str, fake_backend_process: FakeBackend
) -> Iterator[StatestoreServer]:
    server = start_server(
        module_db, fake_backend_process.url, redis_url, module_prefix, {"STATESTORE_ADMIN_TOKENS": ADMIN_TOKENS}
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tokenless_server(
    module_db: str, redis_url: str, module_prefix: str, fake_backend_process: FakeBackend
) -> Iterator[StatestoreServer]:
    server = start_server(module_db, fake_backend_process.url, redis_url, module_prefix, {})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def admin(keys_server: StatestoreServer) -> Iterator[AdminApi]:
    with AdminApi(keys_server.url) as api:
        yield api


@pytest.fixture(scope="module")
def db(module_db: str) -> Database:
    return Database(module_db)


@pytest.fixture(autouse=True)
def _no_policies_left(db: Database) -> Iterator[None]:
    yield
    db.fetch("DELETE FROM policies")


@pytest.fixture
def two_tenants(keys_server: StatestoreServer, admin: AdminApi) -> Iterator[tuple[dict[str, Any], Api, Api]]:
    """A tenant with a policy of its own to be (`own`, returned with its client first) and one on the default."""
    own, own_key = admin.tenant_with_key()
    _, other_key = admin.tenant_with_key()
    with Api(keys_server.url, own_key) as a, Api(keys_server.url, other_key) as b:
        yield own, a, b


# == policy validation =================================================================================================


INVALID_POLICIES: list[tuple[str, Any, list[str]]] = [
    ("default above max", policy(default_ttl_seconds=700, max_ttl_seconds=600), ["default_ttl_seconds", "max_ttl"]),
    ("negative", policy(max_messages=-5), ["max_messages"]),
    ("negative bytes", policy(max_thread_bytes=-1), ["max_thread_bytes"]),
    ("zero ttl", policy(default_ttl_seconds=0), ["default_ttl_seconds"]),
    ("string for int", policy(max_ttl_seconds="600"), ["max_ttl_seconds"]),
    ("float for int", policy(max_messages=1.5), ["max_messages"]),
    ("bool for int", policy(max_thread_bytes=True), ["max_thread_bytes"]),
    ("null", policy(default_ttl_seconds=None), ["default_ttl_seconds"]),
    ("string for bool", policy(threads_enabled="yes"), ["threads_enabled"]),
    ("int for bool", policy(sessions_enabled=1), ["sessions_enabled"]),
    ("unknown field", {**policy(), "retention_days": 3}, ["retention_days"]),
    ("missing field", {k: v for k, v in policy().items() if k != "max_messages"}, ["max_messages"]),
    ("max ttl too long", policy(max_ttl_seconds=10**9), ["max_ttl_seconds"]),
    ("one message", policy(max_messages=1), ["max_messages"]),
    ("too many messages", policy(max_messages=2**31), ["max_messages"]),
    ("too many bytes", policy(max_thread_bytes=2**63), ["max_thread_bytes"]),
    ("not an object", [policy()], []),
]


def test_invalid_policies_are_refused_naming_the_field(admin: AdminApi) -> None:
    tenant = admin.create_tenant()
    audit_before = admin.audit(limit=1)[0]["id"]
    for scope in ("default", tenant["id"]):
        for case, body, named in INVALID_POLICIES:
            response = admin.call("PUT", f"/policies/{scope}", body)
            assert response.status_code == 400, f"{case}: {response.status_code} {response.text}"
            message = error_of(response, 400, "invalid_request_error")["message"]
            for field in named:
                assert field in message, f"{case}: {message!r} does not name {field}"
        not_json = admin.http.put(
            f"/policies/{scope}", content=b"{not json", headers={"content-type": "application/json"}
        )
        error_of(not_json, 400, "invalid_request_error")
        # Nothing was stored, nothing audited.
        assert admin.ok("GET", f"/policies/{scope}")["source"] == "settings"
    assert admin.audit(limit=1)[0]["id"] == audit_before
    error_of(admin.call("PUT", "/policies/no-such-tenant", policy()), 404, "not_found_error")
    error_of(admin.call("GET", "/policies/no-such-tenant"), 404, "not_found_error")
    error_of(admin.call("DELETE", "/policies/default"), 404, "not_found_error")
    # The edges themselves are accepted.
    edge = policy(default_ttl_seconds=1, max_ttl_seconds=1, max_messages=2, max_thread_bytes=1)
    assert admin.ok("PUT", "/policies/default", edge)["policy"] == edge


# == overrides and TTL clamping =======================================================================================


def test_tenant_policy_beats_the_default_and_the_ttl_header_is_clamped(
    two_tenants: tuple[dict[str, Any], Api, Api], admin: AdminApi
) -> None:
    own, a, b = two_tenants
    admin.put_policy("default", default_ttl_seconds=100, max_ttl_seconds=600)
    assert admin.put_policy(own["id"], default_ttl_seconds=50, max_ttl_seconds=120)["source"] == "tenant"
    assert admin.ok("GET", f"/policies/{own['name']}")["policy"]["max_ttl_seconds"] == 120
    view = admin.ok("GET", f"/policies/{own['id']}")
    assert (view["source"], view["policy"]) == ("tenant", policy(default_ttl_seconds=50, max_ttl_seconds=120))
    assert admin.ok("GET", "/policies/default")["source"] == "default"

    # Defaults.
    assert_about(granted_ttl(a.create("own default")), 50)
    assert_about(granted_ttl(b.create("other default")), 100)
    # statestore-ttl, clamped to each one's maximum; a shorter one is granted as asked.
    assert_about(granted_ttl(a.create("long", ttl=100_000)), 120)
    assert_about(granted_ttl(b.create("long", ttl=100_000)), 600)
    assert_about(granted_ttl(a.create("short", ttl=30)), 30)
    assert_about(granted_ttl(b.session(unique("s"), "short", ttl=30)), 30)
    assert_about(granted_ttl(a.session(unique("s"), "long", ttl=100_000)), 120)
    # On a continue too; the thread's own expires_at is what the header said.
    thread_id, head = created(b.create("to continue", ttl=20))
    response = b.continue_(head, "longer please", ttl=100_000)
    assert_about(granted_ttl(response), 600)
    expires = rfc3339(json_of(b.thread(thread_id))["expires_at"])
    assert expires == pytest.approx(rfc3339(response.headers["statestore-expires-at"]), abs=1)
    # A bad header is a plain 400.
    for bad in ("abc", "0", "-5", "1.5"):
        error_of(b.create("bad ttl", ttl=None, headers={"statestore-ttl": bad}), 400, "invalid_request_error")

    # Without its override the tenant follows the default.
    view = admin.ok("DELETE", f"/policies/{own['id']}")
    assert (view["source"], view["policy"]["default_ttl_seconds"]) == ("default", 100)
    assert_about(granted_ttl(a.create("after delete")), 100)
    assert_about(granted_ttl(a.create("after delete", ttl=100_000)), 600)


def _expires_in(api: Api, thread_id: str) -> float:
    info = json_of(api.thread(thread_id))
    return rfc3339(info["expires_at"]) - rfc3339(info["last_used_at"])


def test_lowering_the_max_ttl_shortens_live_threads_at_once(
    two_tenants: tuple[dict[str, Any], Api, Api], admin: AdminApi
) -> None:
    own, a, b = two_tenants
    admin.put_policy("default", default_ttl_seconds=100, max_ttl_seconds=600)
    admin.put_policy(own["id"], default_ttl_seconds=60, max_ttl_seconds=1000)
    long_b, _ = created(b.create("long", ttl=500))
    short_b, _ = created(b.create("short", ttl=50))
    long_a, head_a = created(a.create("own long", ttl=900))
    assert _expires_in(b, long_b) == pytest.approx(500, abs=1)
    assert _expires_in(a, long_a) == pytest.approx(900, abs=1)

    admin.put_policy("default", default_ttl_seconds=100, max_ttl_seconds=200)
    # At once, before any further use: the threads the default governs, and only those.
    assert _expires_in(b, long_b) == pytest.approx(200, abs=0.01)
    assert _expires_in(b, short_b) == pytest.approx(50, abs=1)
    assert _expires_in(a, long_a) == pytest.approx(900, abs=1)
    # Their next turn gets the new maximum as well.
    head_b = json_of(b.thread(long_b))["head_message_id"]
    assert_about(granted_ttl(b.continue_(head_b, "next")), 200)

    admin.put_policy(own["id"], default_ttl_seconds=60, max_ttl_seconds=300)
    assert _expires_in(a, long_a) == pytest.approx(300, abs=0.01)
    # Dropping the override hands the tenant's threads to the default, whose maximum is lower still.
    admin.ok("DELETE", f"/policies/{own['id']}")
    assert _expires_in(a, long_a) == pytest.approx(200, abs=0.01)
    assert_about(granted_ttl(a.continue_(head_a, "next")), 200)


# == threads and sessions switched off ================================================================================


def test_threads_off_is_unsupported_and_the_sdk_can_go_on_unthreaded(
    keys_server: StatestoreServer, two_tenants: tuple[dict[str, Any], Api, Api], admin: AdminApi, backend: FakeBackend
) -> None:
    own, a, b = two_tenants
    thread_id, head = created(a.create("before"))
    admin.put_policy(own["id"], threads_enabled=False)
    backend.reset()
    for response in (a.create("create"), a.continue_(head, "continue"), a.session("s-off", "session")):
        error_of(response, 400, "invalid_request_error", "thread_unsupported_request")
    assert backend.requests() == []
    assert a.stateless("stateless still works").status_code == 200
    created(b.create("the other tenant still threads"))

    key = a.api_key
    assert key is not None
    with anthropic.Anthropic(base_url=keys_server.url, api_key=key, max_retries=0) as sdk:
        strict = sdk.beta.messages.thread(model=MODEL, max_tokens=64)
        with pytest.raises(anthropic.BadRequestError) as refused:
            strict.send(user("strict"))
        assert isinstance(refused.value.body, dict)
        assert refused.value.body["error"]["details"]["error_code"] == "thread_unsupported_request"

        backend.reset()
        lenient = sdk.beta.messages.thread(
            model=MODEL, max_tokens=64, unsupported_request_behavior="continue_unthreaded"
        )
        first = lenient.send(user("one"))
        second = lenient.send(user("two"))
    assert thread_of_response(first.id) is None
    assert thread_of_response(second.id) is None
    # statestore refused the create, so the SDK sent the turn unthreaded, and the next one with the whole history.
    bodies = [request.json() for request in backend.requests()]
    assert len(bodies) == 2
    assert all("thread" not in body for body in bodies)
    assert bodies[-1]["messages"] == [user("one"), said("one"), user("two")]

    # Switched on again, the thread made before is where it was.
    admin.put_policy(own["id"], threads_enabled=True)
    assert created(a.continue_(head, "after"))[0] == thread_id


def test_sessions_off_refuses_the_session_header(
    two_tenants: tuple[dict[str, Any], Api, Api], admin: AdminApi, backend: FakeBackend
) -> None:
    own, a, b = two_tenants
    _, head = created(a.create("plain"))
    admin.put_policy(own["id"], sessions_enabled=False)
    backend.reset()
    error_of(a.session("s-1", "session"), 400, "invalid_request_error", "thread_unsupported_request")
    error_of(
        a.create("create naming a session", session="s-2"), 400, "invalid_request_error", "thread_unsupported_request"
    )
    assert backend.requests() == []
    # Threads without a session name still work; other tenants' sessions too.
    created(a.continue_(head, "continue"))
    created(a.create("create"))
    created(b.session("s-1", "other tenant"))


# == limits: all or nothing ===========================================================================================


def test_max_messages_refuses_the_turn_and_stores_nothing(
    two_tenants: tuple[dict[str, Any], Api, Api], admin: AdminApi, backend: FakeBackend
) -> None:
    own, a, _ = two_tenants
    admin.put_policy(own["id"], max_messages=6)
    thread_id, head = created(a.create("one"))
    before = json_of(a.thread(thread_id))
    backend.reset()
    five = [user("a"), said("a"), user("b"), said("b"), user("c")]
    error_of(a.continue_(head, five), 400, "invalid_request_error")
    error_of(a.create([user("x"), said("x"), user("y"), said("y"), user("z"), said("z")]), 400, "invalid_request_error")
    assert backend.requests() == []
    assert json_of(a.thread(thread_id)) == before
    assert a.thread_ids() == [thread_id]
    # The same id is still continuable, up to the limit.
    _, head = created(a.continue_(head, "two"))
    _, head = created(a.continue_(head, "three"))
    assert json_of(a.thread(thread_id))["message_count"] == 6
    error_of(a.continue_(head, "four"), 400, "invalid_request_error")
    assert json_of(a.thread(thread_id))["message_count"] == 6
    admin.put_policy(own["id"], max_messages=8)
    created(a.continue_(head, "four"))
    assert json_of(a.thread(thread_id))["message_count"] == 8


def test_max_thread_bytes_refuses_the_turn_and_stores_nothing(
    two_tenants: tuple[dict[str, Any], Api, Api], admin: AdminApi, backend: FakeBackend
) -> None:
    own, a, _ = two_tenants
    admin.put_policy(own["id"], max_thread_bytes=2000)
    thread_id, head = created(a.create("small"))
    before = json_of(a.thread(thread_id))
    backend.reset()
    error_of(a.continue_(head, "x" * 3000), 413, "request_too_large")
    error_of(a.create("y" * 3000), 413, "request_too_large")
    error_of(a.create("small", system="z" * 3000), 413, "request_too_large")
    assert backend.requests() == []
    assert json_of(a.thread(thread_id)) == before
    assert a.thread_ids() == [thread_id]
    created(a.continue_(head, "still small"))
    assert json_of(a.thread(thread_id))["message_count"] == 4


# == audit ============================================================================================================


def test_audit_records_every_admin_change_without_content_or_secrets(
    keys_server: StatestoreServer, admin: AdminApi, db: Database
) -> None:
    start = max((e["id"] for e in admin.audit(limit=1)), default=0)
    secret_text = f"confidential-{secrets.token_hex(6)}"
    system_text = f"system-{secrets.token_hex(6)}"
    user_id = unique("user")

    tenant = admin.create_tenant()
    key = admin.create_key(tenant["id"], label="ci")
    with Api(keys_server.url, key["secret"]) as api:
        _, head = created(api.create(secret_text, system=system_text, metadata={"user_id": user_id}))
        created(api.continue_(head, secret_text + " again"))
    with AdminApi(keys_server.url, AUDITOR_TOKEN) as auditor:
        auditor.ok("POST", f"/tenants/{tenant['id']}/disable")
    admin.ok("POST", f"/tenants/{tenant['name']}/enable")
    admin.ok("DELETE", f"/keys/{key['id']}")
    first_policy = policy(max_ttl_seconds=600)
    second_policy = policy(max_ttl_seconds=900)
    admin.ok("PUT", f"/policies/{tenant['id']}", first_policy)
    admin.ok("PUT", f"/policies/{tenant['id']}", second_policy)
    admin.ok("DELETE", f"/policies/{tenant['id']}")
    admin.ok("PUT", "/policies/default", first_policy)
    admin.ok("DELETE", "/policies/default")
    admin.purge()
    nothing_else = {"erased_responses": 0, "erased_conversations": 0}
    assert admin.erase({"user_id": user_id}) == {"erased_threads": 1, **nothing_else}
    assert admin.erase({"tenant": tenant["name"]}) == {"erased_threads": 0, **nothing_else}

    page = admin.ok("GET", "/audit", limit=50)
    entries = [e for e in page["data"] if e["id"] > start]
    assert [e["id"] for e in entries] == sorted((e["id"] for e in entries), reverse=True)
    entries.reverse()
    assert [(e["actor"], e["action"], e["target"]) for e in entries] == [
        ("ops", "tenant.create", tenant["id"]),
        ("ops", "key.create", key["id"]),
        ("auditor", "tenant.disable", tenant["id"]),
        ("ops", "tenant.enable", tenant["id"]),
        ("ops", "key.revoke", key["id"]),
        ("ops", "policy.put", tenant["id"]),
        ("ops", "policy.put", tenant["id"]),
        ("ops", "policy.delete", tenant["id"]),
        ("ops", "policy.put", "default"),
        ("ops", "policy.delete", "default"),
        ("ops", "purge", None),
        ("ops", "erase", f"user_id={user_id}"),
        ("ops", "erase", f"tenant={tenant['id']}"),
    ]
    by_step = entries
    assert (by_step[0]["before"], by_step[0]["after"]) == (None, tenant)
    assert by_step[1]["before"] is None
    assert by_step[1]["after"] == {k: v for k, v in key.items() if k != "secret"}
    assert (by_step[2]["before"]["disabled"], by_step[2]["after"]["disabled"]) == (False, True)
    assert (by_step[3]["before"]["disabled"], by_step[3]["after"]["disabled"]) == (True, False)
    assert (by_step[4]["before"]["revoked_ms"], by_step[4]["after"]["revoked_ms"] is not None) == (None, True)
    assert (by_step[5]["before"], by_step[5]["after"]) == (None, first_policy)
    assert (by_step[6]["before"], by_step[6]["after"]) == (first_policy, second_policy)
    assert (by_step[7]["before"], by_step[7]["after"]) == (second_policy, None)
    assert by_step[10]["after"] == {"threads": 0, "responses": 0, "conversations": 0}
    assert by_step[11]["after"] == {
        "threads": 1,
        "responses": 0,
        "conversations": 0,
        "data_keys": 0,
        "tenant_id": None,
        "user_id": user_id,
    }
    times = [e["at_ms"] for e in entries]
    assert times == sorted(times)

    # Paging: `before` is an entry id; has_more says whether older entries remain, exactly.
    older = admin.ok("GET", "/audit", limit=2, before=entries[-1]["id"])
    assert [e["id"] for e in older["data"]] == [entries[-2]["id"], entries[-3]["id"]]
    assert older["has_more"] is True
    first, second, third = sorted(e["id"] for e in admin.audit(limit=1000))[:3]
    last_two = admin.ok("GET", "/audit", limit=2, before=third)
    assert ([e["id"] for e in last_two["data"]], last_two["has_more"]) == ([second, first], False)
    assert admin.ok("GET", "/audit", limit=1, before=third)["has_more"] is True
    error_of(admin.call("GET", "/audit", limit=0), 400, "invalid_request_error")
    error_of(admin.call("GET", "/audit", limit=1001), 400, "invalid_request_error")

    # Never message content, never a key secret or its hash: not in the audit log, not in the server's log.
    key_hash = hashlib.sha256(key["secret"].encode()).hexdigest()
    for blob in (orjson.dumps(page).decode(), str(db.fetch("SELECT * FROM audit_log")), keys_server.log()):
        for needle in (secret_text, system_text, "echo: ", key["secret"], key_hash, ADMIN_TOKEN):
            assert needle not in blob


# == tenants and keys through the API =================================================================================


def test_tenants_and_keys_api(keys_server: StatestoreServer, admin: AdminApi) -> None:
    tenant = admin.create_tenant()
    assert admin.ok("GET", f"/tenants/{tenant['id']}") == tenant
    assert admin.ok("GET", f"/tenants/{tenant['name']}") == tenant
    assert tenant in admin.ok("GET", "/tenants")["data"]
    error_of(admin.call("POST", "/tenants", {"name": tenant["name"]}), 409, "invalid_request_error")
    for bad in ("", "   ", "default", "x" * 201, {"name": "x", "extra": 1}):
        body = bad if isinstance(bad, dict) else {"name": bad}
        error_of(admin.call("POST", "/tenants", body), 400, "invalid_request_error")
    # A name shaped like a tenant id could stand for another tenant wherever tenants are named by id or name.
    message = error_of(admin.call("POST", "/tenants", {"name": tenant["id"]}), 400, "invalid_request_error")
    assert "ten_" in message["message"]
    error_of(admin.call("GET", "/tenants/no-such-tenant"), 404, "not_found_error")

    # A key needs no label, so no body either.
    bare = json_of(admin.http.post(f"/tenants/{tenant['name']}/keys"), 201)
    labelled = admin.create_key(tenant["id"], label="ci")
    assert (bare["label"], labelled["label"]) == (None, "ci")
    listed = admin.ok("GET", f"/tenants/{tenant['id']}/keys")["data"]
    assert [k["id"] for k in listed] == [bare["id"], labelled["id"]]
    assert all("secret" not in k and "key_hash" not in k for k in listed)
    with Api(keys_server.url, bare["secret"]) as api:
        assert api.models().status_code == 200
        assert admin.ok("DELETE", f"/keys/{bare['id']}")["revoked_ms"] is not None
        error_of(api.models(), 401, "authentication_error")
    error_of(admin.call("DELETE", "/keys/key_nope"), 404, "not_found_error")
    error_of(admin.call("POST", "/tenants/no-such-tenant/keys", {}), 404, "not_found_error")


# == who may call the admin API =======================================================================================


ADMIN_ROUTES: list[tuple[str, str, Any]] = [
    ("GET", "/tenants", None),
    ("POST", "/tenants", {"name": "intruder"}),
    ("GET", "/tenants/{tenant}", None),
    ("POST", "/tenants/{tenant}/disable", None),
    ("POST", "/tenants/{tenant}/enable", None),
    ("GET", "/tenants/{tenant}/keys", None),
    ("POST", "/tenants/{tenant}/keys", {"label": "intruder"}),
    ("DELETE", "/keys/{key}", None),
    ("GET", "/policies/default", None),
    ("PUT", "/policies/default", policy(threads_enabled=False)),
    ("PUT", "/policies/default", {"not": "a policy"}),
    ("DELETE", "/policies/default", None),
    ("GET", "/audit", None),
    ("POST", "/purge", None),
    ("POST", "/erase", {"tenant": "{tenant}"}),
    ("GET", "/stats", None),
]


def _admin_calls(base_url: str, headers: dict[str, str], tenant: str, key: str) -> list[tuple[str, httpx.Response]]:
    out = []
    with httpx.Client(base_url=base_url + "/admin/v1", headers=headers, timeout=20) as http:
        for method, path, body in ADMIN_ROUTES:
            url = path.format(tenant=tenant, key=key)
            content = orjson.dumps(body).decode().replace("{tenant}", tenant).encode() if body is not None else None
            extra = {"content-type": "application/json"} if content is not None else {}
            out.append((f"{method} {url}", http.request(method, url, content=content, headers=extra)))
    return out


def test_admin_routes_need_an_admin_token(
    keys_server: StatestoreServer, passthrough_server: StatestoreServer, admin: AdminApi
) -> None:
    tenant, secret = admin.tenant_with_key()
    key_id = admin.ok("GET", f"/tenants/{tenant['id']}/keys")["data"][0]["id"]
    audit_before = admin.audit(limit=1)[0]["id"]
    refused: list[tuple[str, dict[str, str]]] = [
        (keys_server.url, {}),
        (keys_server.url, {"authorization": "Bearer wrong-token-0123456789abcdef"}),
        (keys_server.url, {"authorization": f"Bearer {ADMIN_TOKEN}x"}),
        (keys_server.url, {"authorization": ADMIN_TOKEN}),
        (keys_server.url, {"x-api-key": ADMIN_TOKEN}),
        (keys_server.url, {"authorization": f"Bearer {secret}"}),
        (keys_server.url, {"x-api-key": secret}),
        (passthrough_server.url, {"x-api-key": "sk-ant-passthrough-credential"}),
        (passthrough_server.url, {"authorization": "Bearer sk-ant-passthrough-credential"}),
    ]
    for base_url, headers in refused:
        for route, response in _admin_calls(base_url, headers, tenant["id"], key_id):
            assert response.status_code == 401, f"{route} with {headers}: {response.status_code} {response.text}"
            error_of(response, 401, "authentication_error")
    # Nothing changed.
    assert admin.audit(limit=1)[0]["id"] == audit_before
    assert admin.ok("GET", f"/tenants/{tenant['id']}")["disabled"] is False
    with Api(keys_server.url, secret) as api:
        assert api.models().status_code == 200
    # Both configured tokens work, on either server.
    for base_url in (keys_server.url, passthrough_server.url):
        for token in (ADMIN_TOKEN, AUDITOR_TOKEN):
            with AdminApi(base_url, token) as other:
                assert other.ok("GET", "/stats")["live_threads"] >= 0


def test_admin_api_is_off_without_admin_tokens(tokenless_server: StatestoreServer) -> None:
    for headers in ({}, {"authorization": f"Bearer {ADMIN_TOKEN}"}, {"x-api-key": "sk-ant-anything"}):
        for route, response in _admin_calls(tokenless_server.url, headers, "ten_x", "key_x"):
            assert response.status_code == 403, f"{route}: {response.status_code} {response.text}"
            assert "STATESTORE_ADMIN_TOKENS" in error_of(response, 403, "permission_error")["message"]


def test_an_admin_token_is_not_a_tenant_credential(keys_server: StatestoreServer, backend: FakeBackend) -> None:
    for token in (ADMIN_TOKEN, AUDITOR_TOKEN):
        for bearer in (True, False):
            with Api(keys_server.url, token, bearer=bearer) as api:
                for response in (
                    api.stateless("hi"),
                    api.create("hi"),
                    api.session("s", "hi"),
                    api.threads(),
                    api.thread("thr_" + "A" * 22),
                    api.models(),
                ):
                    error_of(response, 401, "authentication_error")
    assert backend.requests() == []


# == the CLI ==========================================================================================================


@pytest.fixture(scope="module")
def env(module_db: str, redis_url: str, module_prefix: str) -> dict[str, str]:
    return cli_env(module_db, redis_url=redis_url, redis_prefix=module_prefix)


def _secret_in(text: str) -> str:
    found: list[str] = re.findall(r"ssk_[A-Za-z0-9_-]{20,}", text)
    assert len(found) == 1, text
    return found[0]


def test_cli_warns_of_passthrough_mode_by_its_own_environment(env: dict[str, str]) -> None:
    """The command cannot see the server's mode: its warning says it read its own, and goes with the keys setting."""
    keys_env = {**env, "STATESTORE_AUTH_MODE": "keys", "STATESTORE_UPSTREAM_API_KEY": "sk-backend"}
    warned, quiet = cli_many(
        env,
        [["admin", "tenants", "create", unique("cli-warned")], (keys_env, ["admin", "tenants", "create", unique("q")])],
    )
    cli_ok(warned)
    assert "statestore: warning: statestore runs in passthrough mode" in warned.stderr
    assert "read STATESTORE_AUTH_MODE from its own environment" in warned.stderr
    cli_ok(quiet)
    assert "warning" not in quiet.stderr


def test_cli_tenants_and_keys_round_trip(keys_server: StatestoreServer, env: dict[str, str], db: Database) -> None:
    name, other = unique("cli-tenant"), unique("cli-other")
    made_json, made_text = cli_many(
        env, [["admin", "tenants", "create", name, "--json"], ["admin", "tenants", "create", other]]
    )
    tenant = cli_json(made_json)
    assert tenant["name"] == name and tenant["id"].startswith("ten_") and tenant["disabled"] is False
    assert re.fullmatch(rf"created tenant {other} \(ten_[0-9a-f]+\)\n", cli_ok(made_text))

    listed_json, listed_text, shown_json, shown_text, key_json, key_text = cli_many(
        env,
        [
            ["admin", "tenants", "list", "--json"],
            ["admin", "tenants", "list"],
            ["admin", "tenants", "show", name, "--json"],
            ["admin", "tenants", "show", tenant["id"]],
            ["admin", "keys", "create", name, "--label", "laptop", "--json"],
            ["admin", "keys", "create", tenant["id"]],
        ],
    )
    assert {name, other} <= {t["name"] for t in cli_json(listed_json)["data"]}
    text = cli_ok(listed_text)
    assert text.splitlines()[0].split() == ["ID", "NAME", "DISABLED", "CREATED"]
    assert tenant["id"] in text and name in text and "UTC" in text
    shown = cli_json(shown_json)
    assert shown["id"] == tenant["id"] and shown["stats"]["live_threads"] == 0
    assert cli_ok(shown_text).startswith(f"{name} ({tenant['id']}), created ")
    assert "live_threads: 0" in shown_text.stdout
    json_key = cli_json(key_json)
    assert (json_key["tenant_id"], json_key["label"]) == (tenant["id"], "laptop")
    json_secret = json_key["secret"]
    assert json_secret.startswith(json_key["prefix"])
    text_secret = _secret_in(cli_ok(key_text))
    assert "only time" in key_text.stdout
    (text_key_id,) = re.findall(r"key_[0-9a-f]+", key_text.stdout)

    # Each secret works against the keys-mode server.
    with Api(keys_server.url, json_secret) as by_json, Api(keys_server.url, text_secret) as by_text:
        created(by_json.create("from a CLI key"))
        assert by_text.models().status_code == 200
        assert len(by_text.thread_ids()) == 1

        keys_json, keys_text, revoked, disabled_other = cli_many(
            env,
            [
                ["admin", "keys", "list", name, "--json"],
                ["admin", "keys", "list", name],
                ["admin", "keys", "revoke", json_key["id"], "--json"],
                ["admin", "tenants", "disable", other],
            ],
        )
        assert {k["id"] for k in cli_json(keys_json)["data"]} == {json_key["id"], text_key_id}
        # A secret is printed once, at creation.
        for output in (keys_json.stdout, keys_text.stdout):
            assert json_secret not in output and text_secret not in output
        assert "laptop" in keys_text.stdout and json_key["prefix"] in keys_text.stdout

        # Revoked: refused at once (STATESTORE_KEY_CACHE_SECONDS=0); the other key still works.
        assert cli_json(revoked)["id"] == json_key["id"] and cli_json(revoked)["revoked_ms"] is not None
        assert f"disabled {other}" in cli_ok(disabled_other)
        error_of(by_json.threads(), 401, "authentication_error")
        assert by_text.threads().status_code == 200

        # Disabled: every key refused; enabled: back.
        disabled, enabled_other = cli_many(
            env, [["admin", "tenants", "disable", name, "--json"], ["admin", "tenants", "enable", other, "--json"]]
        )
        assert cli_json(disabled)["disabled"] is True
        assert cli_json(enabled_other)["disabled"] is False
        error_of(by_text.threads(), 401, "authentication_error")
        assert f"enabled {name}" in cli_ok(cli(env, "admin", "tenants", "enable", tenant["id"]))
        assert by_text.threads().status_code == 200

        assert f"revoked {text_key_id}" in cli_ok(cli(env, "admin", "keys", "revoke", text_key_id))
        error_of(by_text.threads(), 401, "authentication_error")

    # The key secrets are stored hashed only.
    stored = str(db.fetch("SELECT * FROM api_keys WHERE tenant_id = $1", tenant["id"]))
    assert json_secret not in stored and text_secret not in stored


def test_cli_policy_audit_stats_erase_purge_round_trip(
    keys_server: StatestoreServer, env: dict[str, str], admin: AdminApi, db: Database
) -> None:
    """Independent commands run side by side (each process takes a while to start)."""
    tenant, secret = admin.tenant_with_key(unique("cli-policy"))
    other, other_secret = admin.tenant_with_key(unique("cli-other"))
    name = tenant["name"]
    actor = ["--actor", "cli:tester"]
    set_json, set_text = cli_many(
        env,
        [
            # (Fields not given keep the values in force, which the default's change running alongside may set.)
            [
                *("admin", "policy", "set", name, "--default-ttl-seconds", "60", "--max-ttl-seconds", "120"),
                *("--max-messages", "100000", "--json", *actor),
            ],
            ["admin", "policy", "set", "default", "--max-messages", "5000", "--sessions-enabled", "true", *actor],
        ],
    )
    assert cli_json(set_json) == {"scope": name, "policy": policy(default_ttl_seconds=60, max_ttl_seconds=120)}
    assert "policy for default set:" in cli_ok(set_text) and "max_messages: 5000" in set_text.stdout

    # The server applies it at once (STATESTORE_POLICY_CACHE_SECONDS=0).
    user_id = unique("cli-user")
    with Api(keys_server.url, secret) as api, Api(keys_server.url, other_secret) as other_api:
        response = api.create("under the CLI's policy", ttl=100_000, metadata={"user_id": user_id})
        thread_id, _ = created(response)
        assert_about(granted_ttl(response), 120)
        kept, _ = created(api.create("another"))
        other_thread, _ = created(other_api.create("the other tenant's"))

        show_json, show_text, stats_json, stats_text = cli_many(
            env,
            [
                ["admin", "policy", "show", name, "--json"],
                ["admin", "policy", "show", "default"],
                ["admin", "stats", "--tenant", name, "--json"],
                ["admin", "stats"],
            ],
        )
        assert cli_json(show_json) == {
            "scope": name,
            "source": "tenant",
            "policy": policy(default_ttl_seconds=60, max_ttl_seconds=120),
        }
        assert "(from default)" in cli_ok(show_text) and "max_messages: 5000" in show_text.stdout
        assert cli_json(stats_json)["live_threads"] == 2
        # Each door's counts under its name, the purger's last run after them.
        shown = cli_ok(stats_text)
        messages, responses = shown.index("messages door (threads, sessions):\n"), shown.index("responses door")
        assert messages < shown.index("\n  live_threads: ") < shown.index("\n  purged_threads_total: ") < responses
        assert responses < shown.index("\n  live_conversations: ") < shown.index("\n  purged_responses_total: ")
        assert re.search(r"^purger last ran: (never|\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z)$", shown, re.M)

        erased_json, erased_text = cli_many(
            env,
            [
                ["admin", "erase", "--user-id", user_id, "--json", *actor],
                ["admin", "erase", "--tenant", other["name"], *actor],
            ],
        )
        # The CLI's erasure runs to its end; `admin erasure ID` shows it, as GET /admin/v1/erasures/{id} does.
        done = cli_json(erased_json)
        assert {k: done[k] for k in ("status", "erased_threads", "erased_responses", "erased_conversations")} == {
            "status": "done",
            "erased_threads": 1,
            "erased_responses": 0,
            "erased_conversations": 0,
        }
        assert done["user_id"] == user_id and done["finished_at"] is not None
        assert re.fullmatch(
            r"erasure_[0-9a-f]{24}: done: erased 1 threads, 0 responses and 0 conversations "
            r"\(database rows and cache entries\)\n",
            cli_ok(erased_text),
        )
        shown_json, shown_text = cli_many(
            env, [["admin", "erasure", done["id"], "--json"], ["admin", "erasure", "erasure_nope"]]
        )
        assert cli_json(shown_json) == done
        assert admin.ok("GET", f"/erasures/{done['id']}") == done
        assert shown_text.returncode != 0 and "no erasure 'erasure_nope'" in shown_text.stderr
        assert db.rows_of(thread_id) == (0, 0, 0)
        assert db.rows_of(other_thread) == (0, 0, 0)
        error_of(api.thread(thread_id), 404, "not_found_error")
        assert api.thread_ids() == [kept]
        assert other_api.thread_ids() == []

    deleted_json, deleted_text, purge_json, purge_text = cli_many(
        env,
        [
            ["admin", "policy", "delete", name, "--json", *actor],
            ["admin", "policy", "delete", "default", *actor],
            ["purge", "--json", *actor],
            ["purge"],
        ],
    )
    assert cli_json(deleted_json) == {"scope": name, "deleted": True}
    assert "default now follows the default policy" in cli_ok(deleted_text)
    assert set(cli_json(purge_json)) == {"purged_threads", "purged_responses", "purged_conversations"}
    assert re.fullmatch(r"purged \d+ expired threads, \d+ responses and \d+ conversations\n", cli_ok(purge_text))

    audit_json, audit_text = cli_many(env, [["admin", "audit", "--json", "--limit", "30"], ["admin", "audit"]])
    entries = cli_json(audit_json)["data"]
    mine = [(e["action"], e["target"]) for e in reversed(entries) if e["actor"] == "cli:tester"]
    assert sorted(mine[:2]) == [("policy.put", "default"), ("policy.put", tenant["id"])]
    assert sorted(mine[2:4]) == sorted([("erase", f"user_id={user_id}"), ("erase", f"tenant={other['id']}")])
    assert sorted(mine[4:], key=str) == sorted(
        [("policy.delete", "default"), ("policy.delete", tenant["id"]), ("purge", None)], key=str
    )
    # Without --actor, the login name.
    assert any(e["action"] == "purge" and e["actor"].startswith("cli:") and e["actor"] != "cli:tester" for e in entries)
    text = cli_ok(audit_text)
    assert text.splitlines()[0].split() == ["ID", "WHEN", "ACTOR", "ACTION", "TARGET"]
    assert "cli:tester" in text and "policy.delete" in text and "UTC" in text


def test_cli_errors_are_one_clear_line(env: dict[str, str], admin: AdminApi, tmp_path: Path) -> None:
    existing = admin.create_tenant()["name"]
    bare = cli_env(f"sqlite:///{tmp_path / 'bare.db'}")
    unreachable = cli_env("postgresql://nobody@127.0.0.1:1/none")
    cases: list[tuple[list[str], str] | tuple[tuple[dict[str, str], list[str]], str]] = [
        (["admin", "tenants", "show", "no-such-tenant"], "no tenant 'no-such-tenant'"),
        (["admin", "keys", "create", "no-such-tenant", "--json"], "no tenant 'no-such-tenant'"),
        (["admin", "keys", "revoke", "key_nope"], "no API key 'key_nope'"),
        (["admin", "erase"], "erasure needs a tenant, a user_id, or both"),
        (["admin", "tenants", "create", existing], "already exists"),
        (["admin", "policy", "set", existing, "--default-ttl-seconds", "90000"], "must not exceed max_ttl_seconds"),
        # No database at all: where it looked and the remedy, not a traceback (and no empty file left behind).
        ((bare, ["admin", "tenants", "list"]), f"no SQLite database at {tmp_path / 'bare.db'}"),
        ((unreachable, ["purge", "--json"]), "cannot reach the database"),
    ]
    *results, typo = cli_many(
        env, [*(command for command, _ in cases), ["admin", "policy", "set", existing, "--threads-enabled", "ture"]]
    )
    for result, (_, message) in zip(results, cases, strict=True):
        cli_fails(result, message)
    assert "Create it with `statestore migrate`" in results[6].stderr
    assert not (tmp_path / "bare.db").exists()
    # A mistyped switch is a usage error, never a silent "false".
    assert typo.returncode == 2 and "expected true or false, not 'ture'" in typo.stderr
