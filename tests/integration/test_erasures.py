"""`POST /admin/v1/erase` answers at once (202) with an erasure to poll, though the erasure itself waits out every
replica's remembered data keys before it deletes rows (docs/encryption.md): `GET /admin/v1/erasures/{id}` says
`running` until nothing it erases can be read, then `done` with what it erased. Encryption on, both storage
set-ups."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest

from statestore.sealing import new_key_text
from statestore.threads.ids import thread_of_response
from tests.support.admin_api import ADMIN_TOKENS, MODEL, AdminApi, Api, error_of, json_of, unique, user
from tests.support.fake_backend import FakeBackend
from tests.support.server import StatestoreServer

REMEMBER_SECONDS = 3  # STATESTORE_DATA_KEY_CACHE_SECONDS: what an erasure waits out, with a commit's time


@pytest.fixture(scope="module", params=["postgres", "sqlite"])
def erasing_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, fake_backend_process: FakeBackend
) -> Iterator[StatestoreServer]:
    env = {
        "STATESTORE_ENCRYPTION_KEYS": f"k1:{new_key_text()}",
        "STATESTORE_DATA_KEY_CACHE_SECONDS": str(REMEMBER_SECONDS),
        "STATESTORE_DATABASE_TIMEOUT_SECONDS": "2",
        "STATESTORE_ADMIN_TOKENS": ADMIN_TOKENS,
        "STATESTORE_CHAT_UPSTREAM_URL": fake_backend_process.url,
    }
    if request.param == "postgres":
        url: str = request.getfixturevalue("module_db")
        server = StatestoreServer(
            database_url=url,
            upstream_url=fake_backend_process.url,
            redis_url=request.getfixturevalue("redis_url"),
            redis_prefix=request.getfixturevalue("module_prefix"),
            env=env,
        )
    else:
        from statestore.store.migrate import upgrade

        path: Path = tmp_path_factory.mktemp("erasures") / "statestore.db"
        upgrade(f"sqlite+aiosqlite:///{path}")
        server = StatestoreServer(
            database_url=f"sqlite+aiosqlite:///{path}", upstream_url=fake_backend_process.url, env=env
        )
    yield server
    server.stop()


def test_an_erasure_answers_at_once_and_is_done_when_nothing_of_it_can_be_read(
    erasing_server: StatestoreServer, backend: FakeBackend, api_key: str
) -> None:
    user_id, other = unique("user"), unique("user")
    with (
        anthropic.Anthropic(base_url=erasing_server.url, api_key=api_key, max_retries=0) as sdk,
        openai.OpenAI(base_url=erasing_server.url + "/v1", api_key=api_key, max_retries=0) as client,
        Api(erasing_server.url, api_key) as api,
        AdminApi(erasing_server.url) as admin,
    ):
        thread = sdk.beta.messages.thread(model=MODEL, max_tokens=64, metadata={"user_id": user_id})
        thread.send(user("erase me"))
        erased_thread = thread_of_response(thread.previous_message_id or "")
        kept = sdk.beta.messages.thread(model=MODEL, max_tokens=64, metadata={"user_id": other})
        kept.send(user("keep me"))
        response = client.responses.create(model="echo-1", input="erase me too", metadata={"user_id": user_id})
        kept_thread = thread_of_response(kept.previous_message_id or "")
        assert erased_thread is not None and kept_thread is not None

        started_at = time.monotonic()
        answer = admin.call("POST", "/erase", {"user_id": user_id})
        answered = time.monotonic() - started_at
        started = json_of(answer, 202)
        assert answered < REMEMBER_SECONDS, f"the erase call took {answered:.1f} s"
        assert started["status"] == "running" and started["id"].startswith("erasure_")
        assert answer.headers["location"] == f"/admin/v1/erasures/{started['id']}"
        assert started["user_id"] == user_id and started["tenant_id"] is None
        assert started["erased_threads"] is None and started["finished_at"] is None
        assert (started["attempts"], started["retry_at"]) == (1, None)

        state = started
        while state["status"] == "running":
            assert time.monotonic() - started_at < 60, "the erasure never finished"
            time.sleep(0.1)
            state = admin.ok("GET", f"/erasures/{started['id']}")
        assert state["status"] == "done", state
        # It waited out the replicas' remembered keys before deleting rows, after the call had answered.
        assert time.monotonic() - started_at >= REMEMBER_SECONDS
        assert (state["erased_threads"], state["erased_responses"], state["erased_conversations"]) == (1, 1, 0)
        assert state["finished_at"] is not None and state["created_at"] == started["created_at"]
        assert (state["attempts"], state["retry_at"]) == (1, None)

        # Done: nothing of it is readable, by any door; the rest is untouched.
        error_of(api.thread(erased_thread), 404, "not_found_error")
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(response.id)
        assert api.thread(kept_thread).status_code == 200
        assert next(e for e in admin.audit(limit=5) if e["action"] == "erase")["target"] == f"user_id={user_id}"

        error_of(admin.call("GET", "/erasures/erasure_nope"), 404, "not_found_error")
