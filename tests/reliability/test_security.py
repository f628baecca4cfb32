"""Security proofs against real statestore processes (docs/guarantees.md invariants 5 and 6, docs/protocol.md §7, §8):

- owner isolation on every thread route, under concurrency: two owners hammer each other's ids while continuing
  their own threads; every foreign request is a 404 (never a 403, never `in_flight`, never a byte of the other's
  conversation), and what each owner has is untouched;
- no message content and no secret in the logs: a conversation full of sentinel strings (messages, system prompt,
  tool definitions, tool inputs and results, streams, cut streams, backend errors, rejected and crashing requests)
  and requests with sentinel credentials, then the servers' log files are searched for every sentinel;
- admin and tenant credentials are not interchangeable, in passthrough and in keys mode, and a tenant key is stored
  hashed and never reaches the backend;
- admin tokens are compared in constant time (`hmac.compare_digest` on fixed-length digests, every token compared).
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import statistics
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest

from statestore.auth import AdminTokens, hash_key
from tests.reliability.proof_support import (
    Database,
    assert_client_error,
    continue_body,
    create_body,
    new_key,
    servers_on,
    thread_headers,
    user,
)
from tests.support.fake_backend import FakeBackend, error_action, message_action
from tests.support.server import OWNER_SECRET, StatestoreServer


def sentinel(name: str) -> str:
    # Letters and digits only: JSON or repr() escaping cannot disguise it in a log line.
    return f"zq{name}X{secrets.token_hex(6)}"


@dataclass
class Deployment:
    passthrough: StatestoreServer
    keys: StatestoreServer
    db: Database
    backend: FakeBackend
    admin_token: str
    keys_admin_token: str
    upstream_key: str
    # Every sentinel handed to a server, for the log search.
    sentinels: dict[str, str] = field(default_factory=dict)


@pytest.fixture(scope="module")
def deployment(database: Database, redis_url: str, backend_process: FakeBackend) -> Iterator[Deployment]:
    admin_token, keys_admin_token, upstream_key = sentinel("ADMINTOKEN"), sentinel("KEYSADMIN"), sentinel("UPSTREAM")
    with servers_on(database, redis_url, backend_process) as servers:
        passthrough = servers.start(STATESTORE_ADMIN_TOKENS=f"root:{admin_token}", STATESTORE_LOG_LEVEL="DEBUG")
        keys = servers.start(
            STATESTORE_AUTH_MODE="keys",
            STATESTORE_ADMIN_TOKENS=f"root:{keys_admin_token}",
            STATESTORE_UPSTREAM_API_KEY=upstream_key,
            STATESTORE_LOG_LEVEL="DEBUG",
        )
        yield Deployment(
            passthrough,
            keys,
            database,
            backend_process,
            admin_token,
            keys_admin_token,
            upstream_key,
            {
                "admin token": admin_token,
                "keys admin token": keys_admin_token,
                "upstream key": upstream_key,
                "owner secret": OWNER_SECRET,
            },
        )


@pytest.fixture
async def http(deployment: Deployment) -> AsyncIterator[httpx.AsyncClient]:
    limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
    async with httpx.AsyncClient(base_url=deployment.passthrough.url, timeout=60, limits=limits) as client:
        yield client


# == owner isolation under concurrency ===============================================================================


@dataclass
class OwnerState:
    key: str
    secret_text: str
    threads: dict[str, str] = field(default_factory=dict)  # thread id -> head response id
    session_thread: str = ""


async def _post(http: httpx.AsyncClient, headers: dict[str, str], body: dict[str, Any]) -> httpx.Response:
    return await http.post("/v1/messages", headers=headers, content=orjson.dumps(body))


async def _make_owner(http: httpx.AsyncClient, session_name: str) -> OwnerState:
    owner = OwnerState(new_key(), sentinel("OWNERTEXT"))
    for index in range(4):
        extra = {"statestore-session-id": session_name} if index == 0 else {}
        created = await _post(
            http, thread_headers(owner.key, **extra), create_body([user(f"{owner.secret_text} thread {index}")])
        )
        assert created.status_code == 200, created.text
        thread_id = created.headers["statestore-thread-id"]
        owner.threads[thread_id] = created.json()["id"]
        if index == 0:
            owner.session_thread = thread_id
    return owner


async def test_owners_hammering_each_others_ids_always_get_404(deployment: Deployment, http: httpx.AsyncClient) -> None:
    # Both owners name a session the same: names are per owner.
    alice, bob = await _make_owner(http, "shared-name"), await _make_owner(http, "shared-name")
    deployment.backend.reset()
    # The owners' own continues hold their heads (leased) for a while, so attacks also hit threads in flight.
    deployment.backend.script(*({"kind": "echo", "delay_seconds": 0.5} for _ in range(8)))

    async def attack(attacker: OwnerState, victim: OwnerState) -> list[tuple[str, httpx.Response]]:
        headers = thread_headers(attacker.key)
        plain = {"x-api-key": attacker.key}
        calls = []
        for _ in range(4):
            for thread_id, head in victim.threads.items():
                calls += [
                    ("get", http.get(f"/statestore/v1/threads/{thread_id}", headers=plain)),
                    ("export", http.get(f"/statestore/v1/threads/{thread_id}/messages", headers=plain)),
                    ("delete", http.delete(f"/statestore/v1/threads/{thread_id}", headers=plain)),
                    ("continue", _post(http, headers, continue_body(head, [user("let me in")]))),
                    ("list-after", http.get("/statestore/v1/threads", params={"after": thread_id}, headers=plain)),
                    (
                        "bearer-get",
                        http.get(
                            f"/statestore/v1/threads/{thread_id}", headers={"authorization": f"Bearer {attacker.key}"}
                        ),
                    ),
                ]
            calls.append(("session", http.get("/statestore/v1/sessions/shared-name", headers=plain)))
        results = await asyncio.gather(*(call for _, call in calls))
        return [(name, response) for (name, _), response in zip(calls, results, strict=True)]

    async def own_work(owner: OwnerState) -> list[httpx.Response]:
        continues = [
            _post(http, thread_headers(owner.key), continue_body(head, [user(f"{owner.secret_text} again")]))
            for head in owner.threads.values()
        ]
        listings = [http.get("/statestore/v1/threads", headers={"x-api-key": owner.key}) for _ in range(4)]
        return list(await asyncio.gather(*continues, *listings))

    outcomes = await asyncio.gather(attack(alice, bob), attack(bob, alice), own_work(alice), own_work(bob))
    for attacker, victim, attempts in ((alice, bob, outcomes[0]), (bob, alice, outcomes[1])):
        assert len(attempts) == 4 * (6 * 4 + 1)
        for name, response in attempts:
            assert victim.secret_text.encode() not in response.content, (name, response.text[:300])
            if name == "session":
                assert response.status_code == 200, response.text
                assert response.json()["thread"]["id"] == attacker.session_thread
            elif name == "list-after":
                error = assert_client_error(response, 400)
                assert "details" not in error
            else:
                error = assert_client_error(response, 404)
                if name == "continue":
                    assert error["details"]["error_code"] == "thread_not_found"
    for owner, work in ((alice, outcomes[2]), (bob, outcomes[3])):
        continued = work[: len(owner.threads)]
        assert [r.status_code for r in continued] == [200] * len(owner.threads), [r.text for r in continued]
        for listing in work[len(owner.threads) :]:
            assert {item["id"] for item in listing.json()["data"]} == set(owner.threads)

    # Nothing of either was deleted or changed by the other; each backend request carried one owner's text only.
    for owner in (alice, bob):
        listing = await http.get("/statestore/v1/threads", headers={"x-api-key": owner.key})
        assert {item["id"]: item["message_count"] for item in listing.json()["data"]} == dict.fromkeys(owner.threads, 4)
    forwarded = deployment.backend.requests()
    assert len(forwarded) == 8
    for request in forwarded:
        mine = [o for o in (alice, bob) if o.secret_text.encode() in request.body]
        assert len(mine) == 1, request.body[:300]
        assert request.header("x-api-key") == mine[0].key


async def test_a_session_name_of_another_owner_starts_a_thread_of_ones_own(
    deployment: Deployment, http: httpx.AsyncClient
) -> None:
    alice = await _make_owner(http, "support-ticket-7")
    mallory = new_key()
    deployment.backend.reset()
    turn = await http.post(
        "/v1/messages",
        headers={**thread_headers(mallory), "statestore-session-id": "support-ticket-7"},
        content=orjson.dumps({"model": "m", "max_tokens": 16, "messages": [user("what was said here?")]}),
    )
    assert turn.status_code == 200, turn.text
    assert turn.headers["statestore-thread-id"] != alice.session_thread
    [forwarded] = deployment.backend.requests()
    assert forwarded.json()["messages"] == [user("what was said here?")]
    session = await http.get("/statestore/v1/sessions/support-ticket-7", headers={"x-api-key": alice.key})
    assert session.json()["thread"]["id"] == alice.session_thread
    assert session.json()["thread"]["message_count"] == 2


# == credentials are not interchangeable =============================================================================


async def test_an_admin_token_is_no_tenant_credential_in_passthrough_mode(
    deployment: Deployment, http: httpx.AsyncClient
) -> None:
    """In passthrough mode any credential is an owner of its own: the admin token used as one sees nothing of
    anyone, and a client credential opens nothing of the admin API."""
    owner = await _make_owner(http, "admin-probe")
    for headers in ({"x-api-key": deployment.admin_token}, {"authorization": f"Bearer {deployment.admin_token}"}):
        listing = await http.get("/statestore/v1/threads", headers=headers)
        assert listing.status_code == 200, listing.text
        assert listing.json()["data"] == []
        for thread_id in owner.threads:
            assert_client_error(await http.get(f"/statestore/v1/threads/{thread_id}", headers=headers), 404)
        session = await http.get("/statestore/v1/sessions/admin-probe", headers=headers)
        assert_client_error(session, 404)
    for headers in (
        {"x-api-key": owner.key},
        {"authorization": f"Bearer {owner.key}"},
        {"x-api-key": deployment.admin_token},
        {"authorization": f"Bearer {deployment.admin_token}x"},
        {"authorization": f"Bearer {deployment.keys_admin_token}"},
    ):
        for method, path in (("GET", "/admin/v1/tenants"), ("GET", "/admin/v1/audit"), ("POST", "/admin/v1/purge")):
            assert_client_error(await http.request(method, path, headers=headers), 401)
    ok = await http.get("/admin/v1/tenants", headers={"authorization": f"Bearer {deployment.admin_token}"})
    assert ok.status_code == 200, ok.text


async def test_keys_mode_keeps_admin_and_tenant_credentials_apart(deployment: Deployment) -> None:
    backend = deployment.backend
    admin = {"authorization": f"Bearer {deployment.keys_admin_token}"}
    async with httpx.AsyncClient(base_url=deployment.keys.url, timeout=30) as http:
        tenant = f"sec-{secrets.token_hex(4)}"
        assert (await http.post("/admin/v1/tenants", headers=admin, json={"name": tenant})).status_code == 201
        created = await http.post(f"/admin/v1/tenants/{tenant}/keys", headers=admin, json={"label": "app"})
        assert created.status_code == 201, created.text
        tenant_key, key_id = created.json()["secret"], created.json()["id"]
        deployment.sentinels["tenant key"] = tenant_key

        # A tenant key opens nothing of the admin API.
        for headers in ({"authorization": f"Bearer {tenant_key}"}, {"x-api-key": tenant_key}):
            for method, path in (("GET", "/admin/v1/tenants"), ("POST", f"/admin/v1/tenants/{tenant}/keys")):
                assert_client_error(await http.request(method, path, headers=headers, json={}), 401)
        # The admin token is no tenant key: 401 on every thread route and on a threaded turn, which stores nothing.
        backend.reset()
        for headers in ({"x-api-key": deployment.keys_admin_token}, admin):
            assert_client_error(await http.get("/statestore/v1/threads", headers=headers), 401)
            assert_client_error(await http.get("/statestore/v1/sessions/any", headers=headers), 401)
            without_key = {k: v for k, v in thread_headers("unused").items() if k != "x-api-key"}
            assert_client_error(await _post(http, {**without_key, **headers}, create_body([user("as admin")])), 401)
        assert backend.requests() == []

        # The tenant key works for threads; the backend gets the configured credential, never the tenant's key.
        turn = await _post(http, thread_headers(tenant_key), create_body([user("as tenant")]))
        assert turn.status_code == 200, turn.text
        relayed = await http.post(
            "/v1/messages",
            headers=thread_headers(tenant_key, **{"anthropic-beta": "other-beta"}),
            content=orjson.dumps({"model": "m", "max_tokens": 8, "messages": [user("stateless")]}),
        )
        assert relayed.status_code == 200, relayed.text
        forwarded = backend.requests()
        assert len(forwarded) == 2
        for request in forwarded:
            assert request.header("x-api-key") == deployment.upstream_key
            assert request.header("authorization") is None
            assert all(tenant_key not in value for _, value in request.headers)
        listing = await http.get("/statestore/v1/threads", headers={"x-api-key": tenant_key})
        assert [item["id"] for item in listing.json()["data"]] == [turn.headers["statestore-thread-id"]]

        # Stored hashed: no column of api_keys holds the secret.
        rows = await deployment.db.column_values("api_keys")
        assert rows and not any(tenant_key in str(value) for row in rows for value in row)
        assert any(hash_key(tenant_key) in row for row in rows)

        # Revoked: refused at once by the process that revoked it.
        assert (await http.delete(f"/admin/v1/keys/{key_id}", headers=admin)).status_code == 200
        assert_client_error(await http.get("/statestore/v1/threads", headers={"x-api-key": tenant_key}), 401)


# == constant-time comparison =========================================================================================


def test_admin_tokens_are_compared_with_compare_digest_on_digests_every_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every configured token is compared, through `hmac.compare_digest`, as 32-byte digests: the time taken does
    not depend on which token matched, on how much of a wrong token was right, or on its length."""
    calls: list[tuple[bytes, bytes]] = []
    real: Callable[[bytes, bytes], bool] = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    # statestore.auth calls it through the module, so the spy sees every comparison.
    monkeypatch.setattr(hmac, "compare_digest", spy)
    tokens = AdminTokens({"a" * 20: "first", "b" * 40: "second", "c" * 64: "third"})
    for presented, expected in (
        ("a" * 20, "first"),
        ("c" * 64, "third"),
        ("a" * 19 + "b", None),
        ("x", None),
        ("a" * 5000, None),
    ):
        calls.clear()
        assert tokens.actor([(b"authorization", b"Bearer " + presented.encode())]) == expected
        assert len(calls) == 3, "every token must be compared, whichever matches"
        assert all(len(a) == len(b) == 32 for a, b in calls)
    calls.clear()
    assert tokens.actor([(b"x-api-key", b"a" * 20)]) is None


def test_admin_token_checks_take_the_same_time_right_or_wrong() -> None:
    """A coarse timing check in process (no network noise): the fastest of many runs of a right token, a token wrong
    in its first byte and one wrong in its last byte agree within a wide factor. Only a comparison that stops at the
    first differing byte of a long token, or skips the rest of the table, could fail it."""
    token = secrets.token_urlsafe(48)
    tokens = AdminTokens({token: "root", **{secrets.token_urlsafe(48): f"t{i}" for i in range(20)}})
    candidates = {
        "right": token,
        "wrong-first": ("A" if token[0] != "A" else "B") + token[1:],
        "wrong-last": token[:-1] + ("A" if token[-1] != "A" else "B"),
    }
    headers = {name: [(b"authorization", f"Bearer {value}".encode())] for name, value in candidates.items()}

    def fastest(name: str) -> float:
        runs = []
        for _ in range(15):
            started = time.perf_counter()
            for _ in range(300):
                tokens.actor(headers[name])
            runs.append(time.perf_counter() - started)
        return min(runs)

    timings = {name: statistics.median(fastest(name) for _ in range(3)) for name in candidates}
    assert max(timings.values()) < 2.5 * min(timings.values()), timings


# == no content and no secret in the logs ============================================================================


async def test_no_message_content_and_no_secret_reaches_logs_metrics_or_audit(
    deployment: Deployment, http: httpx.AsyncClient
) -> None:
    s = {
        name: sentinel(name)
        for name in (
            "SYSTEM",
            "USER",
            "TOOLDEF",
            "TOOLINPUT",
            "TOOLRESULT",
            "STREAM",
            "CUT",
            "BACKENDERR",
            "SESSIONMSG",
            "RELAY",
            "BADJSON",
            "DEEP",
            "TOOLONG",
            "PATH",
            "QUERY",
            "APIKEY",
            "BEARER",
            "WRONGADMIN",
        )
    }
    deployment.sentinels.update({f"content {name}": value for name, value in s.items()})
    backend = deployment.backend
    backend.reset()
    key = s["APIKEY"]
    headers = thread_headers(key)
    tool = {"name": "lookup", "description": f"finds {s['TOOLDEF']}", "input_schema": {"type": "object"}}

    # A tool-using conversation: system prompt, tool definition, a tool_use reply with input, a tool_result.
    backend.script(
        message_action(
            [{"type": "tool_use", "id": "toolu_01S", "name": "lookup", "input": {"q": s["TOOLINPUT"]}}],
            stop_reason="tool_use",
        )
    )
    first = await _post(http, headers, create_body([user(s["USER"])], system=s["SYSTEM"], tools=[tool]))
    assert first.status_code == 200, first.text
    result = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_01S", "content": s["TOOLRESULT"]}],
    }
    second = await _post(http, headers, continue_body(first.json()["id"], [result]))
    assert second.status_code == 200, second.text
    # A streamed turn, and one the backend cuts off midway.
    streamed = await _post(http, headers, continue_body(second.json()["id"], [user(s["STREAM"])], stream=True))
    assert streamed.status_code == 200 and b"message_stop" in streamed.content
    head = streamed.headers["statestore-thread-id"]
    backend.script({"kind": "echo", "cut_after_events": 3})
    with pytest.raises(httpx.HTTPError):
        await _post(http, headers, create_body([user(s["CUT"])], stream=True))
    # A backend error, relayed.
    backend.script(error_action(500, "api_error", f"failed on {s['BACKENDERR']}"))
    failed = await _post(http, headers, create_body([user(s["BACKENDERR"])]))
    assert failed.status_code == 500
    # A session turn, a stateless relay with a bearer credential, and reads with content in the path and query.
    session = await _post(
        http,
        {**headers, "statestore-session-id": "log-probe"},
        {"model": "m", "max_tokens": 16, "messages": [user(s["SESSIONMSG"])]},
    )
    assert session.status_code == 200, session.text
    relay = await http.post(
        "/v1/messages",
        headers={"authorization": f"Bearer {s['BEARER']}", "content-type": "application/json"},
        content=orjson.dumps({"model": "m", "max_tokens": 8, "messages": [user(s["RELAY"])]}),
    )
    assert relay.status_code == 200, relay.text
    await http.get(f"/statestore/v1/threads/{s['PATH']}", headers={"x-api-key": key})
    await http.get(
        "/statestore/v1/threads", params={"session_id": s["QUERY"], "after": s["QUERY"]}, headers={"x-api-key": key}
    )
    await http.get(f"/statestore/v1/threads/{head}/messages", headers={"x-api-key": key})
    # Rejected requests, including those that crash or hit a database error today.
    bad = await http.post("/v1/messages", headers=headers, content=orjson.dumps(create_body([user(s["BADJSON"])]))[:-9])
    deep: Any = s["DEEP"]
    for _ in range(300):
        deep = [deep]
    await http.post(
        "/v1/messages",
        headers=headers,
        content=_deep_json(
            create_body([{"role": "user", "content": [{"type": "text", "text": s["DEEP"], "x": deep}]}])
        ),
    )
    await _post(http, headers, create_body([user(s["TOOLONG"])], metadata={"user_id": s["TOOLONG"] * 20}))
    # Admin requests: the right token, a wrong one.
    admin_ok = await http.get("/admin/v1/audit", headers={"authorization": f"Bearer {deployment.admin_token}"})
    assert admin_ok.status_code == 200
    await http.get("/admin/v1/audit", headers={"authorization": f"Bearer {s['WRONGADMIN']}"})
    last = await http.post(
        "/admin/v1/tenants",
        headers={"authorization": f"Bearer {deployment.admin_token}"},
        json={"name": s["PATH"], "oops": s["USER"]},
    )

    # An access line is written once its response has left: wait for the last one, so every line is there.
    deadline = time.monotonic() + 10
    while last.headers["request-id"] not in deployment.passthrough.log():
        assert time.monotonic() < deadline, "the last request's access line never reached the log"
        await asyncio.sleep(0.02)
    logs = {"passthrough server's log": deployment.passthrough.log(), "keys server's log": deployment.keys.log()}
    # Invariant 6 names metrics and the audit log too.
    async with httpx.AsyncClient(timeout=15) as plain:
        for name, server, token in (
            ("passthrough", deployment.passthrough, deployment.admin_token),
            ("keys", deployment.keys, deployment.keys_admin_token),
        ):
            logs[f"{name} metrics"] = (await plain.get(server.url + "/metrics")).text
            audit = await plain.get(
                server.url + "/admin/v1/audit", params={"limit": 1000}, headers={"authorization": f"Bearer {token}"}
            )
            assert audit.status_code == 200, audit.text
            logs[f"{name} audit log"] = audit.text
    # The log holds this test's requests (its access lines carry their request ids): the search is not void.
    assert bad.headers["request-id"] in logs["passthrough server's log"]
    assert "response cut short" in logs["passthrough server's log"]
    leaks = [
        f"{what} found in the {server}: {_line_with(text, value)}"
        for what, value in deployment.sentinels.items()
        for server, text in logs.items()
        if value in text
    ]
    assert not leaks, "\n".join(leaks)


def _deep_json(value: Any) -> bytes:
    import json

    return json.dumps(value, separators=(",", ":")).encode()


def _line_with(text: str, value: str) -> str:
    return next(line for line in text.splitlines() if value in line)[:400]
