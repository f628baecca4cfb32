"""A commit whose reply is lost: found by the fault campaign (seed 2026), where a turn answered 503 "the turn was not
stored" showed up in its thread's history. The database had carried out the commit; only its answer to statestore
was lost with the connection. statestore now fences such a commit (gives the head back) and then looks for the
reply's row: found, the turn is answered as stored; not found, it was not and never will be."""

from __future__ import annotations

import functools
import os
import secrets
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import anthropic
import asyncpg
import httpx
import openai
import orjson
import pytest

from statestore.store.migrate import upgrade
from tests.campaign.commit_loss import commit_lost, lose_commit, through
from tests.campaign.network import FaultProxy, NetworkLoop
from tests.reliability.support import RawClient, ServerProcess, query, sse_data, user
from tests.support.admin_api import run_async
from tests.support.fake_backend import FakeBackend
from tests.support.server import StatestoreServer


@pytest.fixture
def lossy_server(fresh_pg_url: str) -> Iterator[tuple[StatestoreServer, FaultProxy]]:
    upgrade(fresh_pg_url)
    parts = urlsplit(fresh_pg_url)
    assert parts.port is not None
    network = NetworkLoop()
    proxy = FaultProxy(network, "postgres", parts.port)
    try:
        with FakeBackend() as backend:
            server = StatestoreServer(
                database_url=through(fresh_pg_url, proxy.port),
                upstream_url=backend.url,
                env={"STATESTORE_CHAT_UPSTREAM_URL": backend.url},
            )
            try:
                yield server, proxy
            finally:
                server.stop()
    finally:
        proxy.close()
        network.stop()


@pytest.mark.parametrize("kind", ["create", "continue", "stream"])
def test_a_commit_whose_reply_was_lost_is_answered_as_stored(
    lossy_server: tuple[StatestoreServer, FaultProxy], kind: str
) -> None:
    server, proxy = lossy_server
    raw = RawClient(server.url, f"sk-lost-{secrets.token_hex(6)}")
    try:
        previous = None if kind == "create" else raw.ok([user("one")])["id"]
        marker = f"lost-reply-{secrets.token_hex(4)}"
        # The commit is the first statement that carries the new turn's text.
        proxy.faults.lose_reply_after = marker.encode()
        response = raw.turn([user(marker)], previous, stream=kind == "stream")
        assert proxy.faults.lose_reply_after is None, "the commit never went through the proxy"
        assert response.status_code == 200, response.text
        if kind == "stream":
            events = sse_data(response.content)
            assert events[-1]["type"] == "message_stop", events[-1]
            reply_id = events[0]["message"]["id"]
        else:
            reply_id = response.json()["id"]
        thread_id = response.headers["statestore-thread-id"]
        texts = [m["content"] for m in raw.export(thread_id)["messages"] if m["role"] == "user"]
        assert texts == ([] if kind == "create" else ["one"]) + [marker]
        # The head moved to this reply, and the thread goes on from it.
        assert raw.ok([user("after")], reply_id)["content"][0]["text"] == "echo: after"
        assert orjson.loads(raw.http.get(f"/statestore/v1/threads/{thread_id}").content)["message_count"] == (
            len(texts) * 2 + 2
        )
    finally:
        raw.close()


def test_a_background_turn_whose_commit_reply_was_lost_ends_as_stored(
    lossy_server: tuple[StatestoreServer, FaultProxy],
) -> None:
    server, proxy = lossy_server
    marker = f"lost-background-{secrets.token_hex(4)}"
    headers = {"authorization": f"Bearer sk-lost-{secrets.token_hex(6)}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as http:
        # Admitting the turn stores its input; only the commit carries the reply's text.
        proxy.faults.lose_reply_after = f"echo: {marker}".encode()
        queued = http.post("/v1/responses", json={"model": "echo-1", "input": marker, "background": True})
        assert queued.status_code == 200, queued.text
        response_id = queued.json()["id"]
        streamed = http.get(f"/v1/responses/{response_id}", params={"stream": "true"})
        assert proxy.faults.lose_reply_after is None, "the commit never went through the proxy"
        events = sse_data(streamed.content)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert events[-1]["type"] == "response.completed", events[-1]
        polled = http.get(f"/v1/responses/{response_id}").json()
        assert polled["status"] == "completed"
        assert polled["output"][0]["content"][0]["text"] == events[-1]["response"]["output"][0]["content"][0]["text"]
        # a chain goes on from it
        after = http.post(
            "/v1/responses", json={"model": "echo-1", "input": "after", "previous_response_id": response_id}
        )
        assert after.status_code == 200, after.text


def _copies(database_url: str, marker: str) -> int:
    """How many stored responses carry `marker` (in their output, as the echo backend answers it). None may be
    ownerless: the settling's look (an insert of the response id, rolled back) must never have stayed."""

    async def count() -> int:
        conn = await asyncpg.connect(database_url.replace("+asyncpg", ""))
        try:
            assert await conn.fetchval("SELECT count(*) FROM responses WHERE owner = ''") == 0
            found = await conn.fetchval(
                "SELECT count(*) FROM responses WHERE position($1::bytea IN body) > 0", marker.encode()
            )
            return int(found)
        finally:
            await conn.close()

    return run_async(count)


def _texts(client: openai.OpenAI, conversation_id: str) -> list[str]:
    """The conversation's items as text, in order (a user's input as sent, a reply as the echo backend made it)."""
    texts = []
    for item in client.conversations.items.list(conversation_id, order="asc", limit=100).data:
        content = item.content  # type: ignore[union-attr]
        texts.append(content if isinstance(content, str) else "".join(part.text for part in content))  # type: ignore[union-attr]
    return texts


@pytest.mark.parametrize("kind", ["create", "continue", "conversation", "stream"])
def test_a_response_whose_commit_reply_was_lost_is_stored_once(
    lossy_server: tuple[StatestoreServer, FaultProxy], fresh_pg_url: str, kind: str
) -> None:
    """Through the SDK, whose retries are on: a turn whose commit's answer was lost is settled (fenced, then looked
    for) and answered as stored, so the SDK has nothing to retry and no second copy is made (a sibling on a chain, the
    input and reply twice on a conversation)."""
    server, proxy = lossy_server
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=f"sk-lost-{secrets.token_hex(6)}", timeout=30)
    with client:
        extra: dict[str, Any] = {}
        before: list[str] = []
        if kind == "continue":
            extra["previous_response_id"] = client.responses.create(model="echo-1", input="one").id
        elif kind == "conversation":
            conversation = client.conversations.create(items=[{"type": "message", "role": "user", "content": "zero"}])
            client.responses.create(model="echo-1", input="one", conversation=conversation.id)
            extra["conversation"] = conversation.id
            before = _texts(client, conversation.id)
            assert before == ["zero", "one", "echo: one"]
        marker = f"lost-response-{secrets.token_hex(4)}"
        # Nothing is written before the commit, the first statement that carries the turn's text.
        proxy.faults.lose_reply_after = marker.encode()
        if kind == "stream":
            events = list(client.responses.create(model="echo-1", input=marker, stream=True))
            last = events[-1]
            assert last.type == "response.completed", last
            reply = last.response
        else:
            reply = client.responses.create(model="echo-1", input=marker, **extra)
        assert proxy.faults.lose_reply_after is None, "the commit never went through the proxy"
        assert reply.output_text == f"echo: {marker}"
        assert _copies(fresh_pg_url, marker) == 1
        assert client.responses.retrieve(reply.id).output_text == f"echo: {marker}"
        if kind == "conversation":
            assert _texts(client, conversation.id) == [*before, marker, f"echo: {marker}"]
            after = client.responses.create(model="echo-1", input="after", conversation=conversation.id)
        else:
            after = client.responses.create(model="echo-1", input="after", previous_response_id=reply.id)
        assert after.output_text == "echo: after"


def test_an_append_whose_commit_reply_was_lost_adds_its_items_once(
    lossy_server: tuple[StatestoreServer, FaultProxy],
) -> None:
    """`POST /v1/conversations/{id}/items` commits under its own turn id and is settled as a turn is: the SDK's
    request is answered with the items stored, once."""
    server, proxy = lossy_server
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=f"sk-lost-{secrets.token_hex(6)}", timeout=30)
    with client:
        conversation = client.conversations.create(items=[{"type": "message", "role": "user", "content": "zero"}])
        marker = f"lost-append-{secrets.token_hex(4)}"
        # The acknowledgement of the transaction that carries the items is lost, however many statements it has.
        lose_commit(proxy, marker.encode())
        added = client.conversations.items.create(
            conversation.id,
            items=[
                {"type": "message", "role": "user", "content": marker},
                {"type": "message", "role": "assistant", "content": "two"},
            ],
        )
        assert commit_lost(proxy), "the commit never went through the proxy"
        assert len(added.data) == 2
        assert _texts(client, conversation.id) == ["zero", marker, "two"]
        # The conversation is free again, and goes on from there.
        client.responses.create(model="echo-1", input="after", conversation=conversation.id)
        assert _texts(client, conversation.id) == ["zero", marker, "two", "after", "echo: after"]


@pytest.mark.parametrize("kind", ["continue", "conversation", "append"])
def test_a_commit_lost_on_its_way_is_a_503_that_says_not_stored(
    lossy_server: tuple[StatestoreServer, FaultProxy], fresh_pg_url: str, kind: str
) -> None:
    """A commit whose connection failed before the database had it: settled as not stored, a 503 that says so, with
    nothing of it stored and the conversation free, so the same request sent again is stored once."""
    server, proxy = lossy_server
    client = openai.OpenAI(
        base_url=f"{server.url}/v1", api_key=f"sk-lost-{secrets.token_hex(6)}", timeout=30, max_retries=0
    )
    with client:
        conversation = client.conversations.create(items=[{"type": "message", "role": "user", "content": "zero"}])
        head = client.responses.create(model="echo-1", input="one")
        marker = f"dropped-{secrets.token_hex(4)}"

        def send() -> None:
            if kind == "append":
                item = {"type": "message", "role": "user", "content": marker}
                client.conversations.items.create(conversation.id, items=[item])  # type: ignore[list-item]
            elif kind == "conversation":
                client.responses.create(model="echo-1", input=marker, conversation=conversation.id)
            else:
                client.responses.create(model="echo-1", input=marker, previous_response_id=head.id)

        proxy.faults.drop_request_with = marker.encode()
        with pytest.raises(openai.InternalServerError) as refused:
            send()
        assert proxy.faults.drop_request_with is None, "the commit never went through the proxy"
        assert refused.value.status_code == 503
        assert "was not stored" in refused.value.message
        assert refused.value.response.headers.get("retry-after")
        assert _copies(fresh_pg_url, marker) == 0
        assert _texts(client, conversation.id) == ["zero"]
        send()  # the retry the 503 invites: stored once
        expected = {
            "continue": ["zero"],
            "conversation": ["zero", marker, f"echo: {marker}"],
            "append": ["zero", marker],
        }
        assert _texts(client, conversation.id) == expected[kind]
        assert _copies(fresh_pg_url, marker) == (0 if kind == "append" else 1)


def test_a_keyed_response_whose_replica_died_with_its_commit_is_answered_once_by_another(fresh_pg_url: str) -> None:
    """The campaign's lost-commit-kill, once: a keyed Response is committed, its acknowledgement withheld and its
    replica SIGKILLed that moment, so its client hears nothing; the same request under the same key, sent to another
    replica, is answered with that Response (once the dead replica's claim on the key has run out) and stores
    nothing again."""
    upgrade(fresh_pg_url)
    port = urlsplit(fresh_pg_url).port
    assert port is not None
    network = NetworkLoop()
    proxy = FaultProxy(network, "postgres", port)
    try:
        with FakeBackend() as backend:
            env = {"STATESTORE_CHAT_UPSTREAM_URL": backend.url, "STATESTORE_LEASE_SECONDS": "2"}
            start = functools.partial(ServerProcess, upstream_url=backend.url, env=env)
            with ThreadPoolExecutor(2) as starting:  # side by side: each start waits for its server to answer
                started = [
                    starting.submit(start, database_url=url)
                    for url in (through(fresh_pg_url, proxy.port), fresh_pg_url)
                ]
            dying, other = (server.result() for server in started)
            try:
                _answered_once_by_another(fresh_pg_url, proxy, dying, other)
            finally:
                dying.stop()
                other.stop()
    finally:
        proxy.close()
        network.stop()


def _answered_once_by_another(database_url: str, proxy: FaultProxy, dying: ServerProcess, other: ServerProcess) -> None:
    user_id = f"keyed:{secrets.token_hex(4)}"
    body = {"model": "echo-1", "input": "hello", "metadata": {"user_id": user_id}}
    headers = {"authorization": f"Bearer sk-lost-{secrets.token_hex(6)}", "idempotency-key": secrets.token_hex(8)}
    pid = dying.pid
    # The key's claim (inside a transaction) carries the user id too: only the Response's own commit is lost.
    lose_commit(proxy, user_id.encode(), alone=True, then=lambda: os.kill(pid, signal.SIGKILL))
    with pytest.raises(httpx.TransportError):
        httpx.post(f"{dying.url}/v1/responses", json=body, headers=headers, timeout=30)
    assert commit_lost(proxy), "the commit never went through the proxy"
    assert dying.process is not None and dying.process.wait(timeout=10) == -signal.SIGKILL
    stored = query(database_url, "SELECT id FROM responses WHERE metadata_user_id = :u", {"u": user_id})
    assert len(stored) == 1, "the commit was carried out"
    deadline = time.monotonic() + 20
    while True:
        retried = httpx.post(f"{other.url}/v1/responses", json=body, headers=headers, timeout=30)
        if retried.status_code != 409 or time.monotonic() > deadline:
            break
        time.sleep(0.5)  # idempotency_key_in_flight: the dead replica's claim runs out within the lease
    assert retried.status_code == 200, retried.text
    assert retried.headers.get("idempotent-replayed") == "true"
    assert retried.json()["id"] == stored[0][0]
    assert retried.json()["output"][0]["content"][0]["text"] == "echo: hello"
    again = httpx.post(f"{other.url}/v1/responses", json=body, headers=headers, timeout=30)
    assert again.status_code == 200 and again.json() == retried.json()
    assert query(database_url, "SELECT id FROM responses WHERE metadata_user_id = :u", {"u": user_id}) == stored


@pytest.mark.parametrize("fault", ["lost_reply", "dropped"])
def test_a_keyed_thread_turn_whose_commit_was_lost_is_stored_once(
    lossy_server: tuple[StatestoreServer, FaultProxy], fault: str
) -> None:
    """A continue sent with an Idempotency-Key through the `anthropic` SDK, whose retries are on: a commit whose
    acknowledgement was lost is answered as stored, and the same request sent again with its key is replayed; a commit
    dropped on its way is a 503 the SDK retries with the key, stored once."""
    server, proxy = lossy_server
    api_key = f"sk-lost-{secrets.token_hex(6)}"
    with anthropic.Anthropic(base_url=server.url, api_key=api_key, max_retries=2, timeout=30) as client:

        def send(words: str, previous: str | None, key: str | None = None) -> Any:
            thread = {"type": "continue", "previous_message_id": previous} if previous else {"type": "create"}
            return client.beta.messages.with_raw_response.create(
                model="claude-test",
                max_tokens=64,
                messages=[{"role": "user", "content": words}],
                betas=["message-threads-2026-08-12"],
                extra_body={"thread": thread},
                extra_headers={"Idempotency-Key": key} if key else {},
            )

        root = send("one", None).parse()
        marker = f"keyed-{fault}-{secrets.token_hex(4)}"
        key = f"key-{secrets.token_hex(8)}"
        if fault == "lost_reply":
            proxy.faults.lose_reply_after = marker.encode()
        else:
            proxy.faults.drop_request_with = marker.encode()
        first = send(marker, root.id, key)
        assert proxy.faults.lose_reply_after is None and proxy.faults.drop_request_with is None, (
            "the commit never went through the proxy"
        )
        reply = first.parse()
        assert reply.content[0].text == f"echo: {marker}"
        # Dropped: the SDK retried the 503 with the key (the same claim), and that retry stored the turn.
        assert first.retries_taken == (1 if fault == "dropped" else 0)
        again = send(marker, root.id, key)
        assert again.headers["idempotent-replayed"] == "true" and again.parse().id == reply.id
        thread_id = first.headers["statestore-thread-id"]
        exported = httpx.get(
            f"{server.url}/statestore/v1/threads/{thread_id}/messages", headers={"x-api-key": api_key}, timeout=10
        ).json()
        texts = [m["content"] for m in exported["messages"] if m["role"] == "user"]
        assert texts == ["one", marker]
        assert send("after", reply.id).parse().content[0].text == "echo: after"
