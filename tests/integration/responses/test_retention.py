"""Responses and conversations under statestore's owners, tenants, policies, TTL, purge, erasure, audit and stats:
keys mode, a clock the tests move forward, and the admin API."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime

import openai
import pytest
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from statestore.store.retention_queries import Erasure, RetentionQueries
from tests.integration.responses.conftest import last_chat_request
from tests.support.admin_api import (
    ADMIN_TOKENS,
    UPSTREAM_KEY,
    AdminApi,
    Api,
    ClockFile,
    Database,
    RedisKeys,
    cli,
    cli_env,
    cli_ok,
    created,
    run_async,
    start_server,
)
from tests.support.fake_backend import FakeBackend
from tests.support.server import StatestoreServer


@pytest.fixture(scope="module")
def server(
    module_db: str, redis_url: str, module_prefix: str, clock: ClockFile, fake_backend_process: FakeBackend
) -> Iterator[StatestoreServer]:
    env = {
        "STATESTORE_AUTH_MODE": "keys",
        "STATESTORE_UPSTREAM_API_KEY": UPSTREAM_KEY,
        "STATESTORE_ADMIN_TOKENS": ADMIN_TOKENS,
        "STATESTORE_KEY_CACHE_SECONDS": "0",
        "STATESTORE_POLICY_CACHE_SECONDS": "0",
        "STATESTORE_CLOCK_OFFSET_FILE": str(clock.path),
        "STATESTORE_DEFAULT_TTL_SECONDS": "60",
        "STATESTORE_MAX_TTL_SECONDS": "300",
        "STATESTORE_PURGE_INTERVAL_SECONDS": "3600",
        "STATESTORE_CHAT_UPSTREAM_URL": fake_backend_process.url,
    }
    running = start_server(module_db, fake_backend_process.url, redis_url, module_prefix, env)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def admin(server: StatestoreServer) -> Iterator[AdminApi]:
    with AdminApi(server.url) as api:
        yield api


@pytest.fixture(scope="module")
def cache(redis_url: str, module_prefix: str) -> Iterator[RedisKeys]:
    keys = RedisKeys(redis_url, module_prefix)
    yield keys
    keys.close()


def _client(server: StatestoreServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def _erasable(url: str, *, tenant_id: str | None = None, user_id: str | None = None) -> Erasure:
    """What an erasure would delete now: the count the console's confirmation shows (AdminService.erasable)."""

    async def count() -> Erasure:
        engine = create_async_engine(url, poolclass=NullPool)
        try:
            return await RetentionQueries(engine).count_erasable(tenant_id=tenant_id, user_id=user_id)
        finally:
            await engine.dispose()

    return run_async(count)


def test_tenants_stats_and_erasure_by_tenant(
    server: StatestoreServer, admin: AdminApi, backend: FakeBackend, module_db: str
) -> None:
    tenant, key = admin.tenant_with_key()
    other_tenant, other_key = admin.tenant_with_key()
    with _client(server, key) as mine, _client(server, other_key) as theirs:
        first = mine.responses.create(model="echo-1", input="a")
        # keys mode: the backend gets the configured credential, never the client's statestore key
        assert last_chat_request(backend).header("authorization") == f"Bearer {UPSTREAM_KEY}"
        mine.responses.create(model="echo-1", input="b", previous_response_id=first.id)
        conversation = mine.conversations.create(items=[{"role": "user", "content": "x"}])
        kept = theirs.responses.create(model="echo-1", input="c")
        with pytest.raises(openai.NotFoundError):
            theirs.responses.retrieve(first.id)
        stats = admin.stats(tenant["id"])
        assert (stats["live_responses"], stats["live_conversations"]) == (2, 1)
        assert _erasable(module_db, tenant_id=tenant["id"]) == Erasure(threads=0, responses=2, conversations=1)
        before = admin.stats()
        erased = admin.erase({"tenant": tenant["id"]})
        after = admin.stats()
        assert erased == {"erased_threads": 0, "erased_responses": 2, "erased_conversations": 1}
        assert _erasable(module_db, tenant_id=tenant["id"]) == Erasure(threads=0, responses=0, conversations=0)
        assert after["erased_responses_total"] - before["erased_responses_total"] == 2
        assert after["erased_conversations_total"] - before["erased_conversations_total"] == 1
        with pytest.raises(openai.NotFoundError):
            mine.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            mine.conversations.retrieve(conversation.id)
        assert theirs.responses.retrieve(kept.id).id == kept.id
        audit = admin.audit()[0]
        assert audit["action"] == "erase" and audit["after"]["responses"] == 2
        assert other_tenant["id"] != tenant["id"]


def test_erasure_by_user_id_takes_whole_trees_and_their_cache(
    server: StatestoreServer, admin: AdminApi, cache: RedisKeys, module_db: str
) -> None:
    _, key = admin.tenant_with_key()
    with _client(server, key) as client:
        root = client.responses.create(model="echo-1", input="anonymous")
        head = client.responses.create(
            model="echo-1", input="mine", previous_response_id=root.id, metadata={"user_id": "user-erase-1"}
        )
        assert cache.keys_of(f"resp:{head.id}")
        conversation = client.conversations.create(metadata={"user_id": "user-erase-1"})
        unrelated = client.responses.create(model="echo-1", input="not theirs", metadata={"user_id": "user-erase-2"})
        # The anonymous root goes too: its tree holds a response of the user's.
        assert _erasable(module_db, user_id="user-erase-1") == Erasure(threads=0, responses=2, conversations=1)
        erased = admin.erase({"user_id": "user-erase-1"})
        assert erased == {"erased_threads": 0, "erased_responses": 2, "erased_conversations": 1}
        assert client.responses.retrieve(unrelated.id).id == unrelated.id
        for gone in (root.id, head.id):
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(gone)
        with pytest.raises(openai.NotFoundError):
            client.conversations.retrieve(conversation.id)
        assert not cache.keys_of(f"resp:{head.id}")
    assert Database(module_db).value("SELECT count(*) FROM response_items WHERE response_id = $1", head.id) == 0


def test_erasure_by_user_id_takes_the_user_s_items_out_of_a_conversation_that_is_not_theirs(
    server: StatestoreServer, admin: AdminApi, backend: FakeBackend, cache: RedisKeys, module_db: str
) -> None:
    """A turn on a conversation stores its items only in the conversation. Erasing the turn's user takes them out of
    it even when the conversation itself belongs to no one or someone else: what they said is gone from its items and
    from the context its next turn sends, and the other turns' items stay."""
    _, key = admin.tenant_with_key()
    with _client(server, key) as client:
        conversation = client.conversations.create(metadata={"user_id": "user-shared-2"})
        client.responses.create(model="echo-1", input="theirs before", conversation=conversation.id)
        mine = client.responses.create(
            model="echo-1", input="mine", conversation=conversation.id, metadata={"user_id": "user-shared-1"}
        )
        client.responses.create(model="echo-1", input="theirs after", conversation=conversation.id)
        assert cache.keys_of(f"conv:{conversation.id}")
        erased = admin.erase({"user_id": "user-shared-1"})
        assert erased == {"erased_threads": 0, "erased_responses": 1, "erased_conversations": 0}
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(mine.id)
        items = client.conversations.items.list(conversation.id, order="asc")
        said = [part.text for item in items.data for part in getattr(item, "content", None) or []]
        assert said == ["theirs before", "echo: theirs before", "theirs after", "echo: theirs after"]
        assert not cache.keys_of(f"conv:{conversation.id}")
        client.responses.create(model="echo-1", input="next", conversation=conversation.id)
        assert [m["content"] for m in last_chat_request(backend).json()["messages"]] == [
            "theirs before", "echo: theirs before", "theirs after", "echo: theirs after", "next",
        ]  # fmt: skip
    database = Database(module_db)
    assert database.value("SELECT count(*) FROM conversation_items WHERE conversation_id = $1", conversation.id) == 6


def test_ttl_purge_and_a_tree_kept_while_any_response_lives(
    server: StatestoreServer,
    admin: AdminApi,
    clock: ClockFile,
    backend: FakeBackend,
    cache: RedisKeys,
    module_db: str,
) -> None:
    _, key = admin.tenant_with_key()
    with _client(server, key) as client:
        old = client.responses.create(model="echo-1", input="old")
        clock.advance(40)
        newer = client.responses.create(model="echo-1", input="newer", previous_response_id=old.id)
        conversation = client.conversations.create()
        clock.advance(30)  # `old` has expired; `newer` lives, and its context holds old's items
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(old.id)
        with pytest.raises(openai.BadRequestError):
            client.responses.create(model="echo-1", input="x", previous_response_id=old.id)
        admin.purge()
        cache.client.delete(*[f"{cache.prefix}{{resp:{newer.id}}}:{part}" for part in ("h", "n")])
        client.responses.create(model="echo-1", input="still", previous_response_id=newer.id)
        assert [m["content"] for m in last_chat_request(backend).json()["messages"]] == [
            "old", "echo: old", "newer", "echo: newer", "still",
        ]  # fmt: skip
        clock.advance(301)
        admin.purge()
        database = Database(module_db)
        assert database.value("SELECT count(*) FROM responses WHERE root_id = $1", old.id) == 0
        assert database.value("SELECT count(*) FROM conversations WHERE id = $1", conversation.id) == 0
        assert not cache.keys_of(f"resp:{newer.id}")


def test_purge_and_stats_count_both_doors(
    server: StatestoreServer, admin: AdminApi, clock: ClockFile, module_db: str, redis_url: str, module_prefix: str
) -> None:
    """What the stats say awaits purge, by kind, is what `statestore purge` then deletes and reports; a purge that an
    admin runs is the purger's last run, given as a time."""
    admin.ok("POST", "/purge")  # what earlier tests left expired
    _, key = admin.tenant_with_key()
    with Api(server.url, key) as api:
        created(api.create("a thread", ttl=30))
    with _client(server, key) as client:
        first = client.responses.create(model="echo-1", input="a")
        client.responses.create(model="echo-1", input="b", previous_response_id=first.id)
        client.conversations.create()
    clock.advance(301)  # past the longest TTL: everything stored so far has expired
    waiting = admin.stats()
    expected = (
        waiting["expired_awaiting_purge"],
        waiting["expired_responses_awaiting_purge"],
        waiting["expired_conversations_awaiting_purge"],
    )
    assert expected[0] >= 1 and expected[1] >= 2 and expected[2] >= 1

    env = cli_env(module_db, redis_url=redis_url, redis_prefix=module_prefix, clock_offset_file=str(clock.path))
    ran_at = clock.now()
    threads, responses, conversations = expected
    assert cli_ok(cli(env, "purge", "--actor", "cli:both-doors")) == (
        f"purged {threads} expired threads, {responses} responses and {conversations} conversations\n"
    )
    after = admin.stats()
    assert (
        after["expired_awaiting_purge"],
        after["expired_responses_awaiting_purge"],
        after["expired_conversations_awaiting_purge"],
    ) == (0, 0, 0)
    totals = ("purged_threads_total", "purged_responses_total", "purged_conversations_total")
    assert tuple(after[name] - waiting[name] for name in totals) == expected
    last_run = datetime.fromisoformat(after["purger_last_run_at"])
    assert after["purger_last_run_at"].endswith("Z") and last_run.utcoffset() is not None
    assert ran_at - 0.01 <= last_run.timestamp() <= clock.now()
    # Deprecated, kept for one release: the same time in epoch milliseconds.
    assert after["purger_last_run_ms"] == round(last_run.timestamp() * 1000)
    [entry] = [e for e in admin.audit(limit=20) if e["actor"] == "cli:both-doors"]
    assert entry["after"] == {"threads": threads, "responses": responses, "conversations": conversations}


def test_a_policy_without_storage_refuses_stored_turns(server: StatestoreServer, admin: AdminApi) -> None:
    tenant, key = admin.tenant_with_key()
    admin.put_policy(tenant["id"], threads_enabled=False)
    with _client(server, key) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model="echo-1", input="x")
        assert refused.value.param == "store"
        assert client.responses.create(model="echo-1", input="x", store=False).output_text == "echo: x"
        with pytest.raises(openai.BadRequestError):
            client.conversations.create()


def test_truncation_auto_applies_the_owners_context_window(
    server: StatestoreServer, admin: AdminApi, backend: FakeBackend
) -> None:
    """`truncation: "auto"` cuts the oldest turns, in one step, once the context passes trigger x window; the chain
    itself stays whole, and `"disabled"` still sends all of it (docs/responses.md, docs/protocol.md §9)."""
    tenant, key = admin.tenant_with_key()
    admin.put_policy(tenant["id"], context_window_tokens=1024, context_trigger_ratio=0.8, context_target_ratio=0.5)
    trigger_bytes = 0.8 * 1024 / 0.25  # the front door's estimate: a quarter of a token per byte
    moved: list[int] = []
    with _client(server, key) as client:
        previous: str | None = None
        for turn in range(8):
            raw = client.responses.with_raw_response.create(
                model="echo-1", input=f"turn {turn} " + "x" * 500, previous_response_id=previous, truncation="auto"
            )
            previous = raw.parse().id
            sent = last_chat_request(backend).json()["messages"]
            assert len(json.dumps(sent, separators=(",", ":"))) <= trigger_bytes, turn
            assert sent[0]["role"] == "user" and sent[-1]["content"].startswith(f"turn {turn} ")
            if raw.headers.get("statestore-context") == "truncated":
                moved.append(turn)
        assert moved, "no turn passed the trigger"
        full = client.responses.create(model="echo-1", input="all", previous_response_id=previous)
        assert len(last_chat_request(backend).json()["messages"]) == 2 * 8 + 1
        assert full.truncation == "disabled"
