"""The owner's thread API (docs/protocol.md §7): list (newest first, cursor-paged, by session), get, export, delete,
sessions.

Runs on the session's shared servers, PostgreSQL + Redis and the embedded SQLite default: every test is an owner of
its own (the `api_key` fixture), so it sees only its own threads."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import anthropic
import orjson
import pytest
from anthropic.types.beta import BetaMessageParam, BetaTextBlockParam, BetaToolParam

from statestore.threads.ids import thread_of_response
from tests.support.admin_api import (
    MODEL,
    Api,
    created,
    error_of,
    json_of,
    rfc3339,
    said,
    user,
)
from tests.support.fake_backend import FakeBackend, message_action
from tests.support.server import StatestoreServer

SYSTEM: list[BetaTextBlockParam] = [
    {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}},
]
WEATHER_TOOL: BetaToolParam = {
    "name": "get_weather",
    "description": "The weather of a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture
def api(server: StatestoreServer, api_key: str) -> Iterator[Api]:
    with Api(server.url, api_key) as owner:
        yield owner


@pytest.fixture
def sdk(server: StatestoreServer, api_key: str) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server.url, api_key=api_key, max_retries=0) as client:
        yield client


def _page(api: Api, **params: Any) -> tuple[list[str], dict[str, Any]]:
    page = json_of(api.threads(**params))
    ids = [item["id"] for item in page["data"]]
    assert page["first_id"] == (ids[0] if ids else None)
    assert page["last_id"] == (ids[-1] if ids else None)
    return ids, page


# == list =============================================================================================================


def test_list_is_newest_first_and_cursor_paged(api: Api, sdk: anthropic.Anthropic) -> None:
    assert json_of(api.threads()) == {"data": [], "has_more": False, "first_id": None, "last_id": None}
    threads = []
    for n in range(5):
        thread = sdk.beta.messages.thread(model=MODEL, max_tokens=64)
        thread.send(user(f"thread {n}"))
        threads.append(thread)
    ids = [thread_of_response(t.previous_message_id or "") for t in threads]
    # Using the oldest makes it the newest: the order is by last use.
    threads[0].send(user("thread 0 again"))
    newest_first = [ids[0], ids[4], ids[3], ids[2], ids[1]]

    listed, page = _page(api)
    assert listed == newest_first
    assert page["has_more"] is False
    assert [item["type"] for item in page["data"]] == ["thread"] * 5
    used = [rfc3339(item["last_used_at"]) for item in page["data"]]
    assert used == sorted(used, reverse=True)

    walked: list[str] = []
    after = None
    pages = []
    while True:
        listed, page = _page(api, limit=2, after=after)
        walked += listed
        pages.append((len(listed), page["has_more"]))
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert walked == newest_first
    assert pages == [(2, True), (2, True), (1, False)]
    # Exactly a page's worth left: has_more is false, not a promise of an empty page.
    listed, page = _page(api, limit=4, after=ids[0])
    assert (listed, page["has_more"]) == (newest_first[1:], False)
    listed, page = _page(api, limit=5)
    assert (listed, page["has_more"]) == (newest_first, False)
    assert _page(api, limit=1)[1]["has_more"] is True

    error_of(api.threads(after="thr_" + "Z" * 22), 400, "invalid_request_error")
    error_of(api.threads(limit=0), 400, "invalid_request_error")
    error_of(api.threads(limit=1001), 400, "invalid_request_error")
    error_of(api.threads(limit="many"), 400, "invalid_request_error")


def test_list_by_session(api: Api) -> None:
    alpha, _ = created(api.session("alpha", "a one"))
    beta, _ = created(api.session("beta", "b one"))
    created(api.create("no session"))
    assert created(api.session("alpha", "a two"))[0] == alpha

    assert _page(api, session_id="alpha")[0] == [alpha]
    assert _page(api, session_id="beta")[0] == [beta]
    assert _page(api, session_id="gamma")[0] == []
    assert len(_page(api)[0]) == 3

    # A session whose thread is gone binds a new thread; the list by session shows the live one.
    json_of(api.delete(alpha))
    alpha2, _ = created(api.session("alpha", "a fresh start"))
    assert alpha2 != alpha
    assert _page(api, session_id="alpha")[0] == [alpha2]


# == get and sessions ==================================================================================================


def test_get_thread_metadata(api: Api) -> None:
    first = api.create("hello there", session="meta-session", metadata={"user_id": "u-meta"})
    thread_id, first_id = created(first)
    info = json_of(api.thread(thread_id))
    assert info["id"] == thread_id
    assert info["type"] == "thread"
    assert (info["message_count"], info["turn_count"], info["head_message_id"]) == (2, 1, first_id)
    assert info["session_id"] == "meta-session"
    assert rfc3339(info["created_at"]) <= rfc3339(info["last_used_at"]) < rfc3339(info["expires_at"])
    assert rfc3339(info["expires_at"]) == pytest.approx(rfc3339(first.headers["statestore-expires-at"]), abs=1)
    assert rfc3339(info["expires_at"]) - rfc3339(info["last_used_at"]) == pytest.approx(300, abs=1)

    second = api.continue_(first_id, "and again")
    _, second_id = created(second)
    later = json_of(api.thread(thread_id))
    assert (later["message_count"], later["turn_count"], later["head_message_id"]) == (4, 2, second_id)
    assert later["created_at"] == info["created_at"]
    assert rfc3339(later["last_used_at"]) >= rfc3339(info["last_used_at"])
    # bytes: the stored messages, exactly.
    exported = json_of(api.export(thread_id))
    assert later["bytes"] == sum(len(orjson.dumps(m)) for m in exported["messages"])
    assert later["bytes"] > info["bytes"] > 0

    session = json_of(api.session_info("meta-session"))
    assert session == {"id": "meta-session", "type": "session", "thread": later}

    error_of(api.thread("thr_" + "Q" * 22), 404, "not_found_error")
    error_of(api.thread("not-a-thread-id"), 404, "not_found_error")
    error_of(api.session_info("no-such-session"), 404, "not_found_error")
    error_of(api.session_info("bad*name"), 400, "invalid_request_error")
    error_of(api.session_info("x" * 129), 400, "invalid_request_error")


def test_sessions_continue_and_report_their_thread(api: Api, backend: FakeBackend) -> None:
    name = f"chat:{secrets.token_hex(3)}.v1_x-y"
    first = api.session(name, "one", system="Be brief.")
    thread_id, first_id = created(first)
    assert first.headers["statestore-session-id"] == name
    second = api.session(name, "two")
    assert created(second)[0] == thread_id
    assert backend.requests()[-1].json()["messages"] == [user("one"), said("one"), user("two")]
    assert backend.requests()[-1].json()["system"] == "Be brief."
    info = json_of(api.session_info(name))["thread"]
    assert (info["id"], info["session_id"], info["message_count"]) == (thread_id, name, 4)
    assert info["head_message_id"] == second.json()["id"] != first_id


# == export ===========================================================================================================


def test_export_is_the_whole_conversation_as_a_request(
    api: Api, sdk: anthropic.Anthropic, backend: FakeBackend
) -> None:
    tool_use: list[dict[str, Any]] = [
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "toolu_01Exp", "name": "get_weather", "input": {"city": "Oslo"}},
    ]
    backend.script(message_action(tool_use, stop_reason="tool_use"))
    thread = sdk.beta.messages.thread(model=MODEL, max_tokens=64, system=SYSTEM, tools=[WEATHER_TOOL])
    thread.send(user("weather in Oslo?"))
    result: BetaMessageParam = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_01Exp", "content": "cold"}],
    }
    thread.send(result)
    # The latest turn's model and max_tokens are the export's (a turn may change them).
    thread.send(user("thanks"), max_tokens=96)
    thread_id = thread_of_response(thread.previous_message_id or "")
    assert thread_id is not None
    conversation = [
        user("weather in Oslo?"),
        {"role": "assistant", "content": tool_use},
        result,
        {"role": "assistant", "content": [{"type": "text", "text": "echo: (1 tool result)"}]},
        user("thanks"),
        said("thanks"),
    ]

    exported = json_of(api.export(thread_id))
    # A Messages request body, nothing else in it: it can be sent anywhere as it is.
    assert list(exported) == ["model", "max_tokens", "system", "tools", "messages"]
    assert exported == {
        "model": MODEL,
        "max_tokens": 96,
        "system": SYSTEM,
        "tools": [WEATHER_TOOL],
        "messages": conversation,
    }

    # Sent as a plain stateless request, it is the conversation the next continue would send.
    backend.reset()
    replay = sdk.beta.messages.create(**exported)
    assert thread_of_response(replay.id) is None
    thread.send(user("one more"))
    stateless, continued = (request.json() for request in backend.requests())
    assert stateless == exported
    assert continued["system"] == stateless["system"]
    assert continued["tools"] == stateless["tools"]
    assert continued["messages"] == [*stateless["messages"], user("one more")]

    # Without system and tools there is only messages.
    plain, _ = created(api.create("plain"))
    assert json_of(api.export(plain)) == {"model": MODEL, "max_tokens": 64, "messages": [user("plain"), said("plain")]}
    error_of(api.export("thr_" + "E" * 22), 404, "not_found_error")


# == delete ===========================================================================================================


def test_delete_erases_the_thread(api: Api, backend: FakeBackend) -> None:
    thread_id, head = created(api.create("to delete", session="doomed"))
    keep, _ = created(api.create("to keep"))

    assert json_of(api.delete(thread_id)) == {"id": thread_id, "type": "thread_deleted"}
    error_of(api.thread(thread_id), 404, "not_found_error")
    error_of(api.export(thread_id), 404, "not_found_error")
    error_of(api.session_info("doomed"), 404, "not_found_error")
    error_of(api.continue_(head, "still there?"), 404, "not_found_error", "thread_not_found")
    assert api.thread_ids() == [keep]
    error_of(api.delete(thread_id), 404, "not_found_error")
    error_of(api.delete("not-a-thread-id"), 404, "not_found_error")
    # The session name is free again: a new thread, with none of the deleted one's messages.
    fresh, _ = created(api.session("doomed", "anew"))
    assert fresh != thread_id
    assert backend.requests()[-1].json()["messages"] == [user("anew")]


def test_a_delete_sent_again_with_its_idempotency_key_answers_the_first_200(api: Api) -> None:
    """A retry of a delete whose answer was lost (§7, §11): with the key it gets the first outcome, not a 404."""
    thread_id, _ = created(api.create("to delete once"))
    other, _ = created(api.create("another"))
    key = {"Idempotency-Key": "delete-" + secrets.token_hex(8)}
    first = api.http.delete(f"/statestore/v1/threads/{thread_id}", headers=key)
    again = api.http.delete(f"/statestore/v1/threads/{thread_id}", headers=key)
    assert json_of(first) == json_of(again) == {"id": thread_id, "type": "thread_deleted"}
    assert again.headers["idempotent-replayed"] == "true" and "idempotent-replayed" not in first.headers
    error_of(api.delete(thread_id), 404, "not_found_error")
    # The key was this delete's: another thread's delete with it is refused, naming the key, and deletes nothing.
    refused = error_of(
        api.http.delete(f"/statestore/v1/threads/{other}", headers=key),
        422,
        "invalid_request_error",
        "idempotency_key_reused",
    )
    assert key["Idempotency-Key"] in refused["message"]
    assert api.thread_ids() == [other]


async def test_threads_stored_before_revision_0007_export_without_model(
    pg_server: StatestoreServer, migrated_pg_url: str, api_key: str
) -> None:
    # Rows written by older code have no model or max_tokens: their export is what it was.
    from sqlalchemy import update

    from statestore.store.engine import create_engine
    from statestore.store.schema import threads

    with Api(pg_server.url, api_key) as api:
        thread_id, _ = created(api.create("old"))
        engine = create_engine(migrated_pg_url, pool_size=1)
        try:
            async with engine.begin() as connection:
                await connection.execute(
                    update(threads).where(threads.c.id == thread_id).values(last_model=None, last_max_tokens=None)
                )
        finally:
            await engine.dispose()
        assert json_of(api.export(thread_id)) == {"messages": [user("old"), said("old")]}
