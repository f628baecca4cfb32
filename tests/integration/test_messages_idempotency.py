"""`Idempotency-Key` on the Messages door's threaded turns (docs/protocol.md §11): a create, a continue or a session
turn sent again with its key stores nothing again and gets the first outcome (the same message id and body, a stream
replayed as its events, `idempotent-replayed: true`); another body under the key is a 422 naming it, in Anthropic's
error shape; a key still running is a 409 the SDK retries by itself; a stateless relay passes the key on and stores
nothing. Through the official `anthropic` SDK against real servers on PostgreSQL + Redis and on SQLite, both with
encryption at rest on (the kept outcome is sealed)."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import orjson
import pytest
from anthropic.types.beta import BetaMessageParam
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from statestore.content_keys import MAGIC
from statestore.sealing import new_key_text
from tests.support.admin_api import passthrough_owner, run_async
from tests.support.fake_backend import FakeBackend
from tests.support.server import StatestoreServer

THREADS_BETA = "message-threads-2026-08-12"
MODEL = "claude-test"
ENV = {"STATESTORE_ENCRYPTION_KEYS": f"k1:{new_key_text()}"}
SLOW = 1.5


@dataclass(frozen=True)
class Served:
    server: StatestoreServer
    database_url: str


@pytest.fixture(scope="module")
def postgres_served(
    module_db: str, redis_url: str, module_prefix: str, fake_backend_process: FakeBackend
) -> Iterator[Served]:
    server = StatestoreServer(
        database_url=module_db,
        upstream_url=fake_backend_process.url,
        redis_url=redis_url,
        redis_prefix=module_prefix,
        env=ENV,
    )
    yield Served(server, module_db)
    server.stop()


@pytest.fixture(scope="module")
def sqlite_served(tmp_path_factory: pytest.TempPathFactory, fake_backend_process: FakeBackend) -> Iterator[Served]:
    from statestore.store.migrate import upgrade

    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('messages-keys') / 'statestore.db'}"
    upgrade(url)
    server = StatestoreServer(database_url=url, upstream_url=fake_backend_process.url, env=ENV)
    yield Served(server, url)
    server.stop()


@pytest.fixture(params=["postgres", "sqlite"])
def served(request: pytest.FixtureRequest, backend: FakeBackend) -> Served:
    value: Served = request.getfixturevalue(f"{request.param}_served")
    return value


@pytest.fixture
def client(served: Served, api_key: str) -> Iterator[anthropic.Anthropic]:
    """The SDK with its retries on, as a client that sends keys would use it."""
    with anthropic.Anthropic(base_url=served.server.url, api_key=api_key, max_retries=2) as sdk:
        yield sdk


def credential(client: anthropic.Anthropic) -> str:
    assert client.api_key is not None
    return client.api_key


def new_key() -> str:
    return "key-" + secrets.token_hex(8)


def user(words: str) -> BetaMessageParam:
    return {"role": "user", "content": words}


def turn(
    client: anthropic.Anthropic,
    words: str,
    key: str | None,
    *,
    thread: dict[str, Any] | None = None,
    session: str | None = None,
    **fields: Any,
) -> Any:
    """A threaded turn as a raw response (its headers, then `.parse()`)."""
    headers = {"Idempotency-Key": key} if key is not None else {}
    if session is not None:
        headers["statestore-session-id"] = session
    return client.beta.messages.with_raw_response.create(
        model=MODEL,
        max_tokens=64,
        messages=[user(words)],
        betas=[THREADS_BETA],
        extra_headers=headers,
        extra_body={"thread": thread} if thread is not None else None,
        **fields,
    )


def message_count(served: Served, api_key: str, thread_id: str) -> int:
    got = httpx.get(
        f"{served.server.url}/statestore/v1/threads/{thread_id}", headers={"x-api-key": api_key}, timeout=10
    )
    assert got.status_code == 200, got.text
    count: int = got.json()["message_count"]
    return count


def sql(url: str, statement: str, **params: Any) -> list[Any]:
    async def go() -> list[Any]:
        engine = create_async_engine(url, poolclass=NullPool)
        try:
            async with engine.begin() as conn:
                result = await conn.execute(text(statement), params)
                return list(result.all()) if result.returns_rows else []
        finally:
            await engine.dispose()

    return run_async(go)


def forget_outcome(served: Served, api_key: str, key: str) -> None:
    """As if the replica that stored the turn had stopped before it kept the outcome: the key holds only the id the
    turn was to store, under a claim that ran out."""
    sql(
        served.database_url,
        "UPDATE idempotency_keys SET outcome = NULL, status = NULL, claim_token = 'gone', claim_expires_ms = 1 "
        "WHERE owner = :o AND key = :k",
        o=passthrough_owner(api_key),
        k=key,
    )


def test_a_create_sent_twice_with_one_key_is_stored_once(client: anthropic.Anthropic, served: Served) -> None:
    key = new_key()
    first = turn(client, "once", key, thread={"type": "create"})
    again = turn(client, "once", key, thread={"type": "create"})
    assert "idempotent-replayed" not in first.headers
    assert again.headers["idempotent-replayed"] == "true"
    assert again.parse().to_dict() == first.parse().to_dict()
    assert again.parse().content[0].text == "echo: once"
    thread_id = first.headers["statestore-thread-id"]
    assert again.headers["statestore-thread-id"] == thread_id
    assert message_count(served, credential(client), thread_id) == 2
    # The kept outcome holds the reply: sealed, with encryption on.
    [(outcome, kept_ms)] = sql(
        served.database_url,
        "SELECT outcome, expires_ms - created_ms FROM idempotency_keys WHERE owner = :o AND key = :k",
        o=passthrough_owner(credential(client)),
        k=key,
    )
    assert bytes(outcome)[: len(MAGIC)] == MAGIC and b"echo: once" not in bytes(outcome)
    assert kept_ms == 86_400_000  # the default policy's idempotency_ttl_seconds


def test_a_continue_retried_with_its_key_is_answered_not_refused(client: anthropic.Anthropic, served: Served) -> None:
    """Before: the second continue from the same id answered 400 "not the thread's latest response"."""
    root = turn(client, "root", None, thread={"type": "create"}).parse()
    key = new_key()
    step = {"type": "continue", "previous_message_id": root.id}
    first = turn(client, "next", key, thread=step)
    again = turn(client, "next", key, thread=step)
    assert again.headers["idempotent-replayed"] == "true"
    assert again.parse().id == first.parse().id and again.parse().content[0].text == "echo: next"
    thread_id = first.headers["statestore-thread-id"]
    assert message_count(served, credential(client), thread_id) == 4
    # The thread goes on from the replayed id.
    after = turn(client, "after", None, thread={"type": "continue", "previous_message_id": again.parse().id})
    assert after.parse().content[0].text == "echo: after"
    assert message_count(served, credential(client), thread_id) == 6
    # Without a key the same continue is still refused: the key is what makes a retry safe.
    with pytest.raises(anthropic.BadRequestError) as refused:
        turn(client, "next", None, thread=step)
    assert refused.value.body["error"]["details"]["error_code"] == "thread_already_continued"  # type: ignore[index]


def test_a_session_turn_retried_with_its_key_stores_once(client: anthropic.Anthropic, served: Served) -> None:
    session = "s-" + secrets.token_hex(6)
    opened = turn(client, "open", None, session=session)
    key = new_key()
    first = turn(client, "in session", key, session=session)
    again = turn(client, "in session", key, session=session)
    assert again.headers["idempotent-replayed"] == "true"
    assert again.parse().id == first.parse().id
    assert again.headers["statestore-session-id"] == session
    thread_id = opened.headers["statestore-thread-id"]
    assert first.headers["statestore-thread-id"] == thread_id
    assert message_count(served, credential(client), thread_id) == 4
    # A session's first turn under a key is a create, stored once too.
    fresh = "s-" + secrets.token_hex(6)
    key = new_key()
    made = turn(client, "new session", key, session=fresh)
    assert turn(client, "new session", key, session=fresh).parse().id == made.parse().id
    assert message_count(served, credential(client), made.headers["statestore-thread-id"]) == 2
    # The session is part of the request: the same body on another session under the key is another request.
    with pytest.raises(anthropic.UnprocessableEntityError):
        turn(client, "new session", key, session=session)


def test_a_streamed_turn_is_replayed_as_the_same_events(client: anthropic.Anthropic, served: Served) -> None:
    key = new_key()

    def events() -> tuple[list[dict[str, Any]], Any]:
        with client.beta.messages.stream(
            model=MODEL,
            max_tokens=64,
            messages=[user("streamed")],
            betas=[THREADS_BETA],
            extra_headers={"Idempotency-Key": key},
            extra_body={"thread": {"type": "create"}},
        ) as stream:
            return [event.to_dict() for event in stream], stream.get_final_message()

    (first, first_message), (second, second_message) = events(), events()
    assert second == first
    assert first[-1]["type"] == "message_stop"
    assert second_message.to_dict() == first_message.to_dict()
    assert first_message.content[0].text == "echo: streamed"
    thread = turn(client, "after", None, thread={"type": "continue", "previous_message_id": first_message.id})
    assert message_count(served, credential(client), thread.headers["statestore-thread-id"]) == 4


def test_a_key_reused_with_another_body_is_refused_naming_the_key(client: anthropic.Anthropic) -> None:
    key = new_key()
    turn(client, "the first words", key, thread={"type": "create"})
    with pytest.raises(anthropic.UnprocessableEntityError) as refused:
        turn(client, "other secret words", key, thread={"type": "create"})
    body = refused.value.body
    assert isinstance(body, dict) and body["type"] == "error" and body["request_id"]
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["details"] == {"error_code": "idempotency_key_reused", "param": "Idempotency-Key"}
    assert key in body["error"]["message"] and "secret" not in orjson.dumps(body).decode()
    assert refused.value.response.headers["x-should-retry"] == "false"
    # Owner-scoped: another credential's request under the same key is its own.
    with anthropic.Anthropic(base_url=str(client.base_url), api_key="sk-other-" + secrets.token_hex(6)) as other:
        mine = turn(other, "mine", key, thread={"type": "create"})
        assert mine.parse().content[0].text == "echo: mine"


def test_a_refused_turn_frees_its_key_and_a_malformed_key_is_refused(client: anthropic.Anthropic) -> None:
    key = new_key()
    with pytest.raises(anthropic.NotFoundError):
        turn(client, "x", key, thread={"type": "continue", "previous_message_id": "msg_" + "0" * 44})
    fixed = turn(client, "fixed", key, thread={"type": "create"})
    assert fixed.parse().content[0].text == "echo: fixed"
    with pytest.raises(anthropic.BadRequestError) as malformed:
        turn(client, "x", "x" * 300, thread={"type": "create"})
    assert malformed.value.body["error"]["details"] == {  # type: ignore[index]
        "error_code": "invalid_idempotency_key",
        "param": "Idempotency-Key",
    }


async def test_a_key_still_running_is_a_409_the_sdk_retries(served: Served, backend: FakeBackend, api_key: str) -> None:
    backend.script({"kind": "echo", "match": "slow", "delay_seconds": SLOW})
    key = new_key()
    headers = {"Idempotency-Key": key}
    fields: Any = {
        "model": MODEL,
        "max_tokens": 64,
        "messages": [user("slow")],
        "betas": [THREADS_BETA],
        "extra_headers": headers,
        "extra_body": {"thread": {"type": "create"}},
    }
    url = served.server.url
    async with (
        anthropic.AsyncAnthropic(base_url=url, api_key=api_key, max_retries=0) as once,
        anthropic.AsyncAnthropic(base_url=url, api_key=api_key, max_retries=3) as retrying,
    ):
        first = asyncio.create_task(once.beta.messages.create(**fields))
        await asyncio.sleep(0.6)
        with pytest.raises(anthropic.ConflictError) as conflict:
            await once.beta.messages.create(**fields)
        body = conflict.value.body
        assert isinstance(body, dict) and body["error"]["details"]["error_code"] == "idempotency_key_in_flight"
        assert key in body["error"]["message"] and conflict.value.response.headers["retry-after"] == "1"
        # The SDK retries a 409 after retry-after by itself, and gets the first outcome.
        waited = await retrying.beta.messages.with_raw_response.create(**fields)
        done = await first
        assert waited.headers["idempotent-replayed"] == "true"
        assert (await waited.parse()).id == done.id
    assert len([r for r in backend.requests() if r.path == "/v1/messages"]) == 1


async def test_a_session_turn_outliving_its_claim_is_waited_for_not_stored_again(
    served: Served, backend: FakeBackend, api_key: str
) -> None:
    """The first attempt still holds the session's head when its claim runs out (its replica stopped renewing the key,
    not the head): a retry finds the head taken, and the key must not be forgotten, or a later retry would store the
    turn a second time. It is answered 409 in flight, then the first outcome once the first attempt has stored."""
    backend.script({"kind": "echo", "match": "outlives", "delay_seconds": SLOW})
    url = served.server.url
    session = "s-" + secrets.token_hex(6)
    key = new_key()
    fields: Any = {
        "model": MODEL,
        "max_tokens": 64,
        "messages": [user("outlives")],
        "betas": [THREADS_BETA],
        "extra_headers": {"Idempotency-Key": key, "statestore-session-id": session},
    }
    async with anthropic.AsyncAnthropic(base_url=url, api_key=api_key, max_retries=0) as sdk:
        opened = await sdk.beta.messages.with_raw_response.create(
            **{**fields, "messages": [user("open")], "extra_headers": {"statestore-session-id": session}}
        )
        first = asyncio.create_task(sdk.beta.messages.create(**fields))
        await asyncio.sleep(0.6)
        await asyncio.to_thread(
            sql,
            served.database_url,
            "UPDATE idempotency_keys SET claim_expires_ms = 1 WHERE owner = :o AND key = :k",
            o=passthrough_owner(api_key),
            k=key,
        )
        with pytest.raises(anthropic.ConflictError) as conflict:
            await sdk.beta.messages.create(**fields)
        body = conflict.value.body
        assert isinstance(body, dict) and body["error"]["details"]["error_code"] == "idempotency_key_in_flight"
        done = await first
        again = await sdk.beta.messages.with_raw_response.create(**fields)
    assert again.headers["idempotent-replayed"] == "true"
    assert (await again.parse()).id == done.id
    assert message_count(served, api_key, opened.headers["statestore-thread-id"]) == 4


def streamed(client: anthropic.Anthropic, words: str, key: str, thread: dict[str, Any]) -> tuple[Any, Any]:
    """A threaded turn as a stream read to its end: its headers and the Message the SDK accumulated."""
    with client.beta.messages.stream(
        model=MODEL,
        max_tokens=64,
        messages=[user(words)],
        betas=[THREADS_BETA],
        extra_headers={"Idempotency-Key": key},
        extra_body={"thread": thread},
    ) as stream:
        return stream.response.headers, stream.get_final_message()


@pytest.mark.parametrize("stream", [False, True])
def test_a_retry_after_an_unrecorded_outcome_answers_from_the_stored_turn(
    client: anthropic.Anthropic, served: Served, stream: bool
) -> None:
    """The turn was stored but its replica stopped before it kept the outcome: the key holds the reply's id, so a
    retry finds the reply stored and answers it (as JSON or as a stream of the Messages API) instead of storing it
    again."""
    root = turn(client, "root", None, thread={"type": "create"}).parse()
    key = new_key()
    step = {"type": "continue", "previous_message_id": root.id}
    if stream:
        first_headers, first = streamed(client, "kept", key, step)
        forget_outcome(served, credential(client), key)
        headers, replayed = streamed(client, "kept", key, step)
    else:
        raw = turn(client, "kept", key, thread=step)
        first_headers, first = raw.headers, raw.parse()
        forget_outcome(served, credential(client), key)
        raw = turn(client, "kept", key, thread=step)
        headers, replayed = raw.headers, raw.parse()
    assert headers["idempotent-replayed"] == "true"
    thread_id = first_headers["statestore-thread-id"]
    assert headers["statestore-thread-id"] == thread_id
    assert replayed.id == first.id
    assert replayed.content[0].text == "echo: kept"
    assert replayed.model == MODEL and replayed.stop_reason == "end_turn"
    assert message_count(served, credential(client), thread_id) == 4
    # A session turn whose thread was known only once it took its head: its reply's id was named under the key then.
    session = "s-" + secrets.token_hex(6)
    turn(client, "open", None, session=session)
    key = new_key()
    made = turn(client, "in session", key, session=session)
    forget_outcome(served, credential(client), key)
    assert turn(client, "in session", key, session=session).parse().id == made.parse().id
    assert message_count(served, credential(client), made.headers["statestore-thread-id"]) == 4


def test_a_relayed_request_passes_its_key_on_and_stores_nothing(
    client: anthropic.Anthropic, served: Served, backend: FakeBackend
) -> None:
    key = new_key()
    for _ in range(2):
        relayed = client.messages.with_raw_response.create(
            model=MODEL,
            max_tokens=64,
            messages=[{"role": "user", "content": "stateless"}],
            extra_headers={"Idempotency-Key": key},
        )
        assert "idempotent-replayed" not in relayed.headers and "statestore-thread-id" not in relayed.headers
    requests = [r for r in backend.requests() if r.path == "/v1/messages"]
    assert [r.header("idempotency-key") for r in requests] == [key, key]
    assert not sql(
        served.database_url,
        "SELECT key FROM idempotency_keys WHERE owner = :o",
        o=passthrough_owner(credential(client)),
    )


def test_a_threaded_turns_key_is_never_sent_to_the_backend(
    client: anthropic.Anthropic, served: Served, backend: FakeBackend
) -> None:
    """statestore answers a threaded turn's key: what the backend is sent under a turn is not the client's request
    (the rebuilt history, a summary, a cut retry), and a backend that honours keys would answer one with another's
    outcome. Before: the key went on with the client's other headers."""
    key = new_key()
    made = turn(client, "keyed", key, thread={"type": "create"})
    step = {"type": "continue", "previous_message_id": made.parse().id}
    turn(client, "keyed again", new_key(), thread=step)
    turn(client, "in a session", new_key(), session="s-" + secrets.token_hex(6))
    sent = [r for r in backend.requests() if r.path == "/v1/messages"]
    assert len(sent) == 3
    assert [r.header("idempotency-key") for r in sent] == [None, None, None]
    assert all(r.header("anthropic-version") for r in sent)  # the client's other headers still go on


def test_a_key_is_kept_under_its_tenant_and_user_for_erasure(client: anthropic.Anthropic, served: Served) -> None:
    """An erasure of the user (or tenant) deletes the keys that carry it (tests/integration/test_idempotency_keys.py
    erases them); a threaded turn's key carries its `metadata.user_id`, as a Responses turn's does."""
    user_id = "user-" + secrets.token_hex(6)
    key = new_key()
    turn(client, "mine", key, thread={"type": "create"}, metadata={"user_id": user_id})
    kept = sql(
        served.database_url,
        "SELECT tenant_id, metadata_user_id FROM idempotency_keys WHERE owner = :o AND key = :k",
        o=passthrough_owner(credential(client)),
        k=key,
    )
    assert kept == [(None, user_id)]
    # A continue that names no user is the thread's user's data: its key goes with that user too, and its outcome is
    # sealed under that user's key.
    thread = turn(client, "first", None, thread={"type": "create"}, metadata={"user_id": user_id})
    step = {"type": "continue", "previous_message_id": thread.parse().id}
    key = new_key()
    turn(client, "next", key, thread=step)
    again = turn(client, "next", key, thread=step)
    assert again.headers["idempotent-replayed"] == "true"
    assert sql(
        served.database_url,
        "SELECT metadata_user_id FROM idempotency_keys WHERE owner = :o AND key = :k",
        o=passthrough_owner(credential(client)),
        k=key,
    ) == [(user_id,)]


def test_the_openapi_document_names_the_header_on_messages(postgres_served: Served) -> None:
    spec = httpx.get(postgres_served.server.url + "/openapi.json", timeout=10).json()
    [parameter] = [p for p in spec["paths"]["/v1/messages"]["post"]["parameters"] if p["in"] == "header"]
    assert parameter["name"] == "Idempotency-Key" and parameter["required"] is False
    assert parameter["schema"]["maxLength"] == 255
