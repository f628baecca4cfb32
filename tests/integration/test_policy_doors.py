"""The retention policy binds both doors (docs/policies.md), on both storage set-ups, with the official SDKs as
clients: a thread, a Responses chain and a conversation under one owner's policy are refused, and stored, alike.

Found by a review: with `max_messages: 4` a thread was refused at its third turn while a Responses chain went on (four
turns, eight messages, all 200).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest

from tests.support.admin_api import ADMIN_TOKENS, MODEL, THREADS_BETA, UPSTREAM_KEY, AdminApi, start_server
from tests.support.fake_backend import FakeBackend, RecordedRequest
from tests.support.server import StatestoreServer

KEYS_MODE = {
    "STATESTORE_AUTH_MODE": "keys",
    "STATESTORE_UPSTREAM_API_KEY": UPSTREAM_KEY,
    "STATESTORE_ADMIN_TOKENS": ADMIN_TOKENS,
}


@pytest.fixture(scope="module")
def postgres_server(
    module_db: str, redis_url: str, module_prefix: str, fake_backend_process: FakeBackend
) -> Iterator[StatestoreServer]:
    env = {**KEYS_MODE, "STATESTORE_CHAT_UPSTREAM_URL": fake_backend_process.url}
    server = start_server(module_db, fake_backend_process.url, redis_url, module_prefix, env)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def sqlite_server(
    tmp_path_factory: pytest.TempPathFactory, fake_backend_process: FakeBackend
) -> Iterator[StatestoreServer]:
    from statestore.store.migrate import upgrade

    url = f"sqlite+aiosqlite:///{Path(tmp_path_factory.mktemp('policy-doors')) / 'statestore.db'}"
    upgrade(url)
    env = {**KEYS_MODE, "STATESTORE_CHAT_UPSTREAM_URL": fake_backend_process.url}
    server = StatestoreServer(database_url=url, upstream_url=fake_backend_process.url, env=env)
    yield server
    server.stop()


@pytest.fixture(params=["postgres", "sqlite"])
def server(request: pytest.FixtureRequest) -> StatestoreServer:
    served: StatestoreServer = request.getfixturevalue(f"{request.param}_server")
    return served


def tenant_under(server: StatestoreServer, **policy: object) -> str:
    """A key of a new tenant whose policy is the defaults with `policy`."""
    with AdminApi(server.url) as admin:
        tenant, key = admin.tenant_with_key()
        admin.put_policy(tenant["id"], **policy)
    return key


def test_max_messages_refuses_the_third_turn_on_every_door(server: StatestoreServer, backend: FakeBackend) -> None:
    key = tenant_under(server, max_messages=4)
    with anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0) as claude:
        thread = claude.beta.messages.thread(model=MODEL, max_tokens=64)
        thread.send({"role": "user", "content": "one"})
        thread.send({"role": "user", "content": "two"})
        with pytest.raises(anthropic.BadRequestError) as refused:
            thread.send({"role": "user", "content": "three"})
        assert "limit of 4 messages" in refused.value.message
    with openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0) as gpt:
        first = gpt.responses.create(model=MODEL, input="one")
        second = gpt.responses.create(model=MODEL, input="two", previous_response_id=first.id)
        with pytest.raises(openai.BadRequestError) as chained:
            gpt.responses.create(model=MODEL, input="three", previous_response_id=second.id)
        assert (chained.value.code, chained.value.param) == ("too_many_messages", "input")
        assert "limit of 4 messages" in chained.value.message
        # A branch from an earlier response carries fewer messages: it is served.
        assert gpt.responses.create(model=MODEL, input="two again", previous_response_id=first.id).output_text

        conversation = gpt.conversations.create()
        gpt.responses.create(model=MODEL, input="one", conversation=conversation.id)
        gpt.responses.create(model=MODEL, input="two", conversation=conversation.id)
        with pytest.raises(openai.BadRequestError) as appended:
            gpt.responses.create(model=MODEL, input="three", conversation=conversation.id)
        assert appended.value.code == "too_many_messages"
        # Refused with nothing stored, and the conversation's lease given back: it holds its four items.
        assert len(gpt.conversations.items.list(conversation.id).data) == 4
        # A turn that stores nothing is no stored conversation's: the limit does not apply to it.
        assert gpt.responses.create(model=MODEL, input="solo", store=False).output_text


def test_every_kind_of_turn_is_refused_at_its_third_under_max_messages(
    server: StatestoreServer, backend: FakeBackend
) -> None:
    """Each other way a turn stores reaches the same enforcement: a session's turns on the Messages door, and a
    streamed, a background and a WebSocket turn on the Responses door, each refused at the third turn under
    `max_messages: 4` with nothing stored (the background one as it would be queued, never queued)."""
    key = tenant_under(server, max_messages=4)
    session = {"statestore-session-id": f"limits-{secrets.token_hex(4)}"}
    with anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0) as claude:
        for text in ("one", "two"):
            claude.messages.create(
                model=MODEL, max_tokens=64, messages=[{"role": "user", "content": text}], extra_headers=session
            )
        with pytest.raises(anthropic.BadRequestError) as refused:
            claude.messages.create(
                model=MODEL, max_tokens=64, messages=[{"role": "user", "content": "three"}], extra_headers=session
            )
        assert "limit of 4 messages" in refused.value.message
    with openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0) as gpt:

        def streamed(text: str, previous: str | None = None) -> str:
            with gpt.responses.stream(model=MODEL, input=text, previous_response_id=previous) as stream:
                return stream.get_final_response().id

        second = streamed("two", streamed("one"))
        with pytest.raises(openai.BadRequestError) as stream_refused:
            streamed("three", second)
        assert stream_refused.value.code == "too_many_messages"

        with pytest.raises(openai.BadRequestError) as background_refused:
            gpt.responses.create(model=MODEL, input="three", previous_response_id=second, background=True)
        assert background_refused.value.code == "too_many_messages"
        assert gpt.responses.create(model=MODEL, input="two again", previous_response_id=second, store=False)

        with gpt.responses.connect() as connection:
            connection.response.create(model=MODEL, input="three", previous_response_id=second)
            event = next(iter(connection))
        assert event.type == "error" and event.error.code == "too_many_messages", event


def test_an_append_is_held_to_the_limits_a_turn_is(server: StatestoreServer, backend: FakeBackend) -> None:
    """`POST /v1/conversations/{id}/items` that would take the conversation over `max_messages` or
    `max_thread_bytes` is refused as a turn over it is, nothing stored and the conversation free (appends went past
    both before: only the next turn was refused)."""
    with AdminApi(server.url) as admin:
        tenant, key = admin.tenant_with_key()
        admin.put_policy(tenant["id"], max_messages=4)
        with openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0) as gpt:
            conversation = gpt.conversations.create()
            gpt.responses.create(model=MODEL, input="one", conversation=conversation.id)
            # Two messages stored and two appended make four: at the limit, not over it.
            gpt.conversations.items.create(
                conversation.id,
                items=[{"type": "message", "role": "user", "content": c} for c in ("two", "three")],
            )
            with pytest.raises(openai.BadRequestError) as refused:
                gpt.conversations.items.create(
                    conversation.id, items=[{"type": "message", "role": "user", "content": "four"}]
                )
            assert (refused.value.code, refused.value.param) == ("too_many_messages", "input")
            assert "limit of 4 messages" in refused.value.message
            assert len(gpt.conversations.items.list(conversation.id).data) == 4
            # The refusal gave the conversation's lease back: under a higher limit the same append goes in at once.
            admin.put_policy(tenant["id"], max_messages=100, max_thread_bytes=400)
            gpt.conversations.items.create(
                conversation.id, items=[{"type": "message", "role": "user", "content": "four"}]
            )
            assert len(gpt.conversations.items.list(conversation.id).data) == 5
            with pytest.raises(openai.BadRequestError) as large:
                gpt.conversations.items.create(
                    conversation.id, items=[{"type": "message", "role": "user", "content": "x" * 400}]
                )
            assert (large.value.code, large.value.param) == ("context_too_large", "input")
            assert len(gpt.conversations.items.list(conversation.id).data) == 5


def test_a_conversation_created_with_items_is_held_to_the_limits_an_append_is(
    server: StatestoreServer, backend: FakeBackend
) -> None:
    """`POST /v1/conversations` with `items` over `max_messages` or `max_thread_bytes` is refused as an append over
    them is, no conversation stored (creation stored any number and size of items before)."""
    with AdminApi(server.url) as admin:
        tenant, key = admin.tenant_with_key()
        admin.put_policy(tenant["id"], max_messages=2, max_thread_bytes=400)
        with openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0) as gpt:
            # At the limits, not over them: stored.
            at_limit = gpt.conversations.create(
                items=[{"type": "message", "role": "user", "content": c} for c in ("one", "two")]
            )
            assert len(gpt.conversations.items.list(at_limit.id).data) == 2
            with pytest.raises(openai.BadRequestError) as refused:
                gpt.conversations.create(
                    items=[{"type": "message", "role": "user", "content": c} for c in ("one", "two", "three")]
                )
            assert (refused.value.code, refused.value.param) == ("too_many_messages", "input")
            assert "limit of 2 messages" in refused.value.message
            with pytest.raises(openai.BadRequestError) as large:
                gpt.conversations.create(items=[{"type": "message", "role": "user", "content": "x" * 400}])
            assert (large.value.code, large.value.param) == ("context_too_large", "input")
            assert "limit of 400 bytes" in large.value.message
        # Nothing stored by either refusal: the tenant holds the one conversation created at the limits.
        assert admin.stats(tenant["id"])["live_conversations"] == 1


def test_a_count_is_held_to_the_limits_its_turn_is_on_both_doors(
    server: StatestoreServer, backend: FakeBackend
) -> None:
    """A count over stored context is refused as the turn it counts would be, on both doors (the Responses door's
    `input_tokens` counted past `max_messages` and `max_thread_bytes` while a count over a thread was refused)."""
    key = tenant_under(server, max_messages=4)
    with anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0) as claude:
        thread = claude.beta.messages.thread(model=MODEL, max_tokens=64)
        thread.send({"role": "user", "content": "one"})
        second = thread.send({"role": "user", "content": "two"})
        with pytest.raises(anthropic.BadRequestError) as refused:
            claude.beta.messages.count_tokens(
                model=MODEL,
                messages=[{"role": "user", "content": "three"}],
                betas=[THREADS_BETA],
                extra_body={"thread": {"type": "continue", "previous_message_id": second.id}},
            )
        assert "limit of 4 messages" in refused.value.message
    with openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0) as gpt:
        first = gpt.responses.create(model=MODEL, input="one")
        assert gpt.responses.input_tokens.count(model=MODEL, input="two", previous_response_id=first.id).input_tokens
        chained = gpt.responses.create(model=MODEL, input="two", previous_response_id=first.id)
        with pytest.raises(openai.BadRequestError) as counted:
            gpt.responses.input_tokens.count(model=MODEL, input="three", previous_response_id=chained.id)
        assert (counted.value.code, counted.value.param) == ("too_many_messages", "input")
        conversation = gpt.conversations.create()
        gpt.responses.create(model=MODEL, input="one", conversation=conversation.id)
        gpt.responses.create(model=MODEL, input="two", conversation=conversation.id)
        with pytest.raises(openai.BadRequestError) as over:
            gpt.responses.input_tokens.count(model=MODEL, input="three", conversation=conversation.id)
        assert over.value.code == "too_many_messages"
        # A count stores nothing and holds nothing: the conversation is as it was.
        assert len(gpt.conversations.items.list(conversation.id).data) == 4
    with AdminApi(server.url) as admin:
        tenant, key = admin.tenant_with_key()
        admin.put_policy(tenant["id"], max_thread_bytes=200)
    with openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0) as gpt:
        first = gpt.responses.create(model=MODEL, input="one")
        with pytest.raises(openai.BadRequestError) as large:
            gpt.responses.input_tokens.count(model=MODEL, input="x" * 300, previous_response_id=first.id)
        assert (large.value.code, large.value.param) == ("context_too_large", "input")


def test_threads_off_refuses_storing_on_every_door(server: StatestoreServer, backend: FakeBackend) -> None:
    key = tenant_under(server, threads_enabled=False)
    with anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0) as claude:
        with pytest.raises(anthropic.BadRequestError) as refused:
            claude.beta.messages.thread(model=MODEL, max_tokens=64).send({"role": "user", "content": "one"})
        assert "threads are turned off" in refused.value.message
    with openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0) as gpt:
        with pytest.raises(openai.BadRequestError) as stored:
            gpt.responses.create(model=MODEL, input="one")
        assert (stored.value.code, stored.value.param) == ("storage_disabled", "store")
        with pytest.raises(openai.BadRequestError) as conversation:
            gpt.conversations.create()
        assert conversation.value.code == "storage_disabled"
        assert gpt.responses.create(model=MODEL, input="one", store=False).output_text == "echo: one"


def test_threads_turned_off_refuses_adding_to_what_was_stored_on_every_door(
    server: StatestoreServer, backend: FakeBackend
) -> None:
    """Storing turned off after a thread and a conversation were stored: continuing either is refused, and so is an
    append to the conversation (appends stored past it before: only the conversation's creation was checked)."""
    with AdminApi(server.url) as admin:
        tenant, key = admin.tenant_with_key()
        with (
            anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0) as claude,
            openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0) as gpt,
        ):
            thread = claude.beta.messages.thread(model=MODEL, max_tokens=64)
            thread.send({"role": "user", "content": "one"})
            conversation = gpt.conversations.create(items=[{"type": "message", "role": "user", "content": "one"}])
            admin.put_policy(tenant["id"], threads_enabled=False)
            with pytest.raises(anthropic.BadRequestError) as continued:
                thread.send({"role": "user", "content": "two"})
            assert "threads are turned off" in continued.value.message
            with pytest.raises(openai.BadRequestError) as turn:
                gpt.responses.create(model=MODEL, input="two", conversation=conversation.id)
            assert turn.value.code == "storage_disabled"
            with pytest.raises(openai.BadRequestError) as appended:
                gpt.conversations.items.create(
                    conversation.id, items=[{"type": "message", "role": "user", "content": "two"}]
                )
            assert appended.value.code == "storage_disabled"
            assert "store: false" not in appended.value.message  # an append has no `store` to send
            assert len(gpt.conversations.items.list(conversation.id).data) == 1
            # What is stored stays readable, and a turn that stores nothing is served from the conversation.
            assert gpt.responses.create(model=MODEL, input="two", conversation=conversation.id, store=False).output_text


def test_lowering_max_ttl_bounds_what_both_doors_stored(server: StatestoreServer, backend: FakeBackend) -> None:
    """A lower max_ttl_seconds shortens live threads at once; it bounds stored responses and conversations alike
    (counted from their creation), their cached chain heads included."""
    with AdminApi(server.url) as admin:
        tenant, key = admin.tenant_with_key()
        admin.put_policy(tenant["id"], default_ttl_seconds=3600, max_ttl_seconds=3600)
        with (
            anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0) as claude,
            openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0) as gpt,
        ):
            reply = claude.beta.messages.thread(model=MODEL, max_tokens=64).send({"role": "user", "content": "one"})
            first = gpt.responses.create(model=MODEL, input="one")
            second = gpt.responses.create(model=MODEL, input="two", previous_response_id=first.id)
            conversation = gpt.conversations.create()
            gpt.responses.create(model=MODEL, input="one", conversation=conversation.id)
            # Under the old policy all of it lives on.
            assert gpt.responses.retrieve(second.id).id == second.id
            admin.put_policy(tenant["id"], default_ttl_seconds=1, max_ttl_seconds=1)
            time.sleep(1.5)
            # (The SDK's thread helper would replay the conversation as a new thread: the continue is sent as is.)
            with pytest.raises(anthropic.NotFoundError) as gone:
                claude.beta.messages.create(
                    model=MODEL,
                    max_tokens=64,
                    messages=[{"role": "user", "content": "two"}],
                    extra_body={"thread": {"type": "continue", "previous_message_id": reply.id}},
                    betas=[THREADS_BETA],
                )
            assert gone.value.body["error"]["details"]["error_code"] == "thread_not_found"  # type: ignore[index]
            with pytest.raises(openai.NotFoundError):
                gpt.responses.retrieve(second.id)
            with pytest.raises(openai.BadRequestError) as chained:
                gpt.responses.create(model=MODEL, input="three", previous_response_id=second.id)
            assert chained.value.code == "previous_response_not_found"
            with pytest.raises(openai.NotFoundError):
                gpt.conversations.retrieve(conversation.id)


@pytest.fixture(scope="module")
def postgres_passthrough_server(
    module_db: str, redis_url: str, module_prefix: str, fake_backend_process: FakeBackend
) -> Iterator[StatestoreServer]:
    env = {"STATESTORE_ADMIN_TOKENS": ADMIN_TOKENS, "STATESTORE_CHAT_UPSTREAM_URL": fake_backend_process.url}
    server = start_server(module_db, fake_backend_process.url, redis_url, module_prefix, env)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def sqlite_passthrough_server(
    tmp_path_factory: pytest.TempPathFactory, fake_backend_process: FakeBackend
) -> Iterator[StatestoreServer]:
    from statestore.store.migrate import upgrade

    url = f"sqlite+aiosqlite:///{Path(tmp_path_factory.mktemp('policy-passthrough')) / 'statestore.db'}"
    upgrade(url)
    env = {"STATESTORE_ADMIN_TOKENS": ADMIN_TOKENS, "STATESTORE_CHAT_UPSTREAM_URL": fake_backend_process.url}
    server = StatestoreServer(database_url=url, upstream_url=fake_backend_process.url, env=env)
    yield server
    server.stop()


def credential_sent(request: RecordedRequest) -> str | None:
    """The credential a request to the backend carried, however it was sent."""
    bearer = request.header("authorization")
    return bearer.removeprefix("Bearer ") if bearer is not None else request.header("x-api-key")


def window_questions(backend: FakeBackend, after: int) -> list[RecordedRequest]:
    return [r for r in backend.requests(after=after) if r.method == "GET" and r.path in ("/v1/models", "/props")]


@pytest.mark.parametrize("storage", ["postgres", "sqlite"])
def test_an_auto_window_is_asked_with_the_clients_credential_on_both_doors(
    request: pytest.FixtureRequest, storage: str, backend: FakeBackend
) -> None:
    """passthrough mode: the backend is asked for a model's window (`context_window_tokens: auto`) with the credential
    the turn itself goes out with, the client's own, on the Responses door as on the Messages door (it was asked with
    none from the Responses door)."""
    server: StatestoreServer = request.getfixturevalue(f"{storage}_passthrough_server")
    with AdminApi(server.url) as admin:
        admin.put_policy("default", context_strategy="truncate", context_window_tokens="auto")
    credential = f"sk-passthrough-{secrets.token_hex(6)}"
    with openai.OpenAI(base_url=server.url + "/v1", api_key=credential, max_retries=0) as gpt:
        before = len(backend.requests())
        gpt.responses.create(model=f"window-{secrets.token_hex(4)}", input="hello", truncation="auto")
        asked = window_questions(backend, before)
    assert asked, "the Responses door did not ask for the window"
    assert {credential_sent(r) for r in asked} == {credential}
    with anthropic.Anthropic(base_url=server.url, api_key=credential, max_retries=0) as claude:
        before = len(backend.requests())
        claude.beta.messages.thread(model=f"window-{secrets.token_hex(4)}", max_tokens=64).send(
            {"role": "user", "content": "hello"}
        )
        asked = window_questions(backend, before)
    assert asked, "the Messages door did not ask for the window"
    assert {credential_sent(r) for r in asked} == {credential}
