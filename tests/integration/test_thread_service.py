"""The turn state machine without HTTP (statestore/threads/service.py): begin takes the head and rebuilds the request,
then exactly one of commit or give_back. On real databases (a migrated SQLite file and PostgreSQL) and the
in-process cache; no backend at all, since the service never calls one."""

from __future__ import annotations

import secrets
import sys
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from statestore.auth import Principal
from statestore.config import Settings
from statestore.core.leased_log import LeasedLog
from statestore.errors import (
    InvalidRequest,
    RequestTooLarge,
    ThreadAlreadyContinued,
    ThreadContinueInFlight,
    ThreadFingerprintMismatch,
    ThreadNotFound,
    ThreadUnsupportedRequest,
)
from statestore.metrics import Metrics
from statestore.policy import Policy
from statestore.store.engine import create_engine
from statestore.store.lease_statements import LeaseStatements
from statestore.store.memory_cache import MemoryHistoryCache
from statestore.store.pg_hot_path import PgHotPath
from statestore.store.thread_repository import ThreadRepository
from statestore.store.turn_records import TurnUsage
from statestore.threads import assembly
from statestore.threads.count import counted_request
from statestore.threads.policy_store import PolicyStore
from statestore.threads.prepared import CompletedReply, PreparedTurn
from statestore.threads.service import ThreadService
from statestore.threads.turn import ThreadTurn, read_turn

BETA = [(b"anthropic-beta", b"message-threads-2026-08-12")]
OWNER = Principal(owner="owner-a", tenant_id=None, upstream_credential=None)
OTHER = Principal(owner="owner-b", tenant_id=None, upstream_credential=None)


class _StaticPolicies(PolicyStore):
    def __init__(self, policy: Policy) -> None:
        self.fallback = policy

    async def for_tenant(self, tenant_id: str | None) -> Policy:
        return self.fallback


def policy(**changes: Any) -> Policy:
    values: dict[str, Any] = {
        "threads_enabled": True,
        "sessions_enabled": True,
        "default_ttl_seconds": 300,
        "max_ttl_seconds": 3600,
        "max_thread_bytes": 1 << 20,
        "max_messages": 100,
    } | changes
    return Policy(**values)


def turn(body: dict[str, Any], headers: list[tuple[bytes, bytes]] | None = None) -> ThreadTurn:
    parsed = read_turn({"model": "m", "max_tokens": 8, **body}, BETA + (headers or []))
    assert parsed is not None
    return parsed


def create(text: str, **fields: Any) -> ThreadTurn:
    return turn({"thread": {"type": "create"}, "messages": [{"role": "user", "content": text}], **fields})


def cont(previous: str, text: str, **fields: Any) -> ThreadTurn:
    thread = {"type": "continue", "previous_message_id": previous}
    return turn({"thread": thread, "messages": [{"role": "user", "content": text}], **fields})


def reply(text: str, **usage: int) -> CompletedReply:
    return CompletedReply(
        row=assembly.stored_reply([{"type": "text", "text": text}]), backend_id="msg_backend", usage=TurnUsage(**usage)
    )


def messages_of(prepared: PreparedTurn) -> list[Any]:
    body: dict[str, Any] = orjson.loads(prepared.upstream_body)
    return list(body["messages"])


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest) -> str:
    url: str = request.getfixturevalue("migrated_sqlite_url" if request.param == "sqlite" else "migrated_pg_url")
    return url


@pytest.fixture
async def service(database_url: str) -> AsyncIterator[ThreadService]:
    settings = Settings(database_url=database_url)
    engine = create_engine(settings)
    single = create_engine(settings, autocommit=True)
    pg = await PgHotPath.open(settings)
    try:
        yield ThreadService(
            leased_log=LeasedLog(LeaseStatements(engine, single, pg)),
            repository=ThreadRepository(engine, single, pg=pg),
            cache=MemoryHistoryCache(),
            policies=_StaticPolicies(policy()),
            lease_seconds=30,
            metrics=Metrics(),
        )
    finally:
        if pg is not None:
            await pg.aclose()
        await single.dispose()
        await engine.dispose()


@pytest.fixture(autouse=True)
def own_owners(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test its own owners, so tests sharing a database never meet (sessions are named per owner)."""
    tag = secrets.token_hex(6)
    monkeypatch.setattr(
        sys.modules[__name__], "OWNER", Principal(owner=f"a-{tag}", tenant_id=None, upstream_credential=None)
    )
    monkeypatch.setattr(
        sys.modules[__name__], "OTHER", Principal(owner=f"b-{tag}", tenant_id=None, upstream_credential=None)
    )


async def test_create_commit_continue_rebuilds_the_conversation(service: ThreadService) -> None:
    first = await service.begin(create("one", system="be brief"), OWNER)
    assert messages_of(first) == [{"role": "user", "content": "one"}]
    await service.commit(first, reply("r1", input_tokens=5))
    assert first.outcome == "stored"

    second = await service.begin(cont(first.response_id, "two"), OWNER)
    body = orjson.loads(second.upstream_body)
    assert body["system"] == "be brief"
    assert body["messages"] == [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": [{"type": "text", "text": "r1"}]},
        {"role": "user", "content": "two"},
    ]
    assert second.thread_id == first.thread_id
    await service.commit(second, reply("r2"))


async def test_the_head_is_held_until_given_back(service: ThreadService) -> None:
    first = await service.begin(create("one"), OWNER)
    await service.commit(first, reply("r1"))
    held = await service.begin(cont(first.response_id, "two"), OWNER)

    with pytest.raises(ThreadContinueInFlight):
        await service.begin(cont(first.response_id, "again"), OWNER)
    await service.give_back(held)
    await service.give_back(held)  # a second give-back is a no-op
    assert held.outcome == "given_back"

    retried = await service.begin(cont(first.response_id, "again"), OWNER)
    assert messages_of(retried)[-1] == {"role": "user", "content": "again"}
    await service.commit(retried, reply("r2"))
    with pytest.raises(ThreadAlreadyContinued):
        await service.begin(cont(first.response_id, "late"), OWNER)


async def test_a_given_back_create_leaves_no_thread(service: ThreadService) -> None:
    made = await service.begin(create("one"), OWNER)
    await service.give_back(made)
    with pytest.raises(ThreadNotFound):
        await service.begin(cont(made.response_id, "two"), OWNER)


async def test_another_owner_cannot_continue(service: ThreadService) -> None:
    first = await service.begin(create("one"), OWNER)
    await service.commit(first, reply("r1"))
    with pytest.raises(ThreadNotFound):
        await service.begin(cont(first.response_id, "mine now"), OTHER)


async def test_commit_after_a_lost_lease_stores_nothing(service: ThreadService) -> None:
    first = await service.begin(create("one"), OWNER)
    await service.commit(first, reply("r1"))
    held = await service.begin(cont(first.response_id, "two"), OWNER)
    held.lease_token = "tok_not_the_lease"  # another request took the head after this one's lease ran out
    with pytest.raises(ThreadContinueInFlight):
        await service.commit(held, reply("lost"))
    assert held.outcome == "open"


async def test_fixed_fields_are_checked(service: ThreadService) -> None:
    first = await service.begin(create("one", system="be brief"), OWNER)
    await service.commit(first, reply("r1"))
    with pytest.raises(ThreadFingerprintMismatch) as mismatch:
        await service.begin(cont(first.response_id, "two", system="be verbose"), OWNER)
    assert "system" in mismatch.value.message
    # The refused continue gave the head back.
    again = await service.begin(cont(first.response_id, "two", system="be brief"), OWNER)
    await service.give_back(again)


async def test_markers_are_counted_and_stripped_from_storage(service: ThreadService) -> None:
    marked = {
        "role": "user",
        "content": [{"type": "text", "text": "one", "cache_control": {"type": "ephemeral"}}],
    }
    first = await service.begin(turn({"thread": {"type": "create"}, "messages": [marked]}), OWNER)
    assert messages_of(first) == [marked]  # forwarded as sent
    await service.commit(first, reply("r1"))
    second = await service.begin(cont(first.response_id, "two"), OWNER)
    assert messages_of(second)[0] == {"role": "user", "content": [{"type": "text", "text": "one"}]}
    await service.give_back(second)

    too_many = [dict(marked) for _ in range(4)]
    with pytest.raises(ThreadUnsupportedRequest):
        await service.begin(turn({"thread": {"type": "create"}, "messages": too_many}), OWNER)


async def test_policy_limits_and_switches(service: ThreadService) -> None:
    service.policies = _StaticPolicies(policy(max_messages=3))
    first = await service.begin(create("one"), OWNER)
    await service.commit(first, reply("r1"))
    with pytest.raises(InvalidRequest, match="3 messages"):
        await service.begin(cont(first.response_id, "two"), OWNER)

    service.policies = _StaticPolicies(policy(max_thread_bytes=10))
    with pytest.raises(RequestTooLarge):
        await service.begin(create("a message longer than ten bytes"), OWNER)

    service.policies = _StaticPolicies(policy(threads_enabled=False))
    with pytest.raises(ThreadUnsupportedRequest):
        await service.begin(create("one"), OWNER)


async def test_sessions_create_then_continue(service: ThreadService) -> None:
    named = [(b"statestore-session-id", b"s-1")]
    first = await service.begin(turn({"messages": [{"role": "user", "content": "one"}]}, named), OWNER)
    assert first.creating and first.session == "s-1"
    await service.commit(first, reply("r1"))
    second = await service.begin(turn({"messages": [{"role": "user", "content": "two"}]}, named), OWNER)
    assert not second.creating and second.thread_id == first.thread_id
    with pytest.raises(ThreadContinueInFlight):
        await service.begin(turn({"messages": [{"role": "user", "content": "x"}]}, named), OWNER)
    await service.give_back(second)


async def test_rebuilds_are_byte_identical_with_and_without_the_cache(service: ThreadService) -> None:
    first = await service.begin(create("one"), OWNER)
    await service.commit(first, reply("r1"))
    warm = await service.begin(cont(first.response_id, "two"), OWNER)
    await service.give_back(warm)
    service.cache = MemoryHistoryCache()  # the hot copy is gone: rebuilt from the database
    cold = await service.begin(cont(first.response_id, "two"), OWNER)
    assert cold.upstream_body == warm.upstream_body
    await service.give_back(cold)


# -- counting the tokens a turn would send (docs/protocol.md §11, threads/count.py) ------------------------------------


async def test_a_count_rebuilds_the_continue_byte_for_byte_and_takes_no_head(service: ThreadService) -> None:
    first = await service.begin(create("one", system="be brief"), OWNER)
    await service.commit(first, reply("r1", input_tokens=40, output_tokens=10))
    counted = await counted_request(service, cont(first.response_id, "two"), OWNER, BETA)
    held = await service.begin(cont(first.response_id, "two"), OWNER)  # the count took nothing
    assert counted.body == held.upstream_body
    # The head held by a continue does not stop a count: it reads the thread as it stands.
    during = await counted_request(service, cont(first.response_id, "two"), OWNER, BETA)
    assert during.body == held.upstream_body
    # The estimate: the 50 tokens the backend counted of the context, and the new message's 32 bytes at the thread's
    # own ratio (those 50 tokens over some 100 bytes: about half a token a byte, not the default quarter).
    assert 60 < counted.estimate < 70
    await service.give_back(held)
    with pytest.raises(ThreadNotFound):
        await counted_request(service, cont(first.response_id, "two"), OTHER, BETA)


def _overtaking(service: ThreadService, monkeypatch: pytest.MonkeyPatch, previous: str) -> ThreadService:
    """A service on the same store with an empty cache (a count reads the rows from the database), whose first read
    of a thread's rows comes after a continue from `previous` committed."""
    load_context = service.repository.load_context
    done: list[bool] = []

    async def commit_first(thread_id: str, *, owner: str) -> list[tuple[int, bytes]]:
        if not done:
            done.append(True)
            went_on = await service.begin(cont(previous, "two"), OWNER)
            await service.commit(went_on, reply("r2"))
        return await load_context(thread_id, owner=owner)

    monkeypatch.setattr(service.repository, "load_context", commit_first)
    return ThreadService(
        leased_log=service.leased_log,
        repository=service.repository,
        cache=MemoryHistoryCache(),
        policies=_StaticPolicies(policy()),
        lease_seconds=30,
        metrics=Metrics(),
    )


async def test_a_count_overtaken_by_a_commit_reads_again(
    service: ThreadService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A continue commits between the count's read of the thread and its read of the rows: the count reads again, and
    answers as a count made after that commit would."""
    session = [(b"statestore-session-id", f"count-{secrets.token_hex(4)}".encode())]
    started = await service.begin(turn({"messages": [{"role": "user", "content": "one"}]}, session), OWNER)
    await service.commit(started, reply("r1"))
    counting = _overtaking(service, monkeypatch, started.response_id)
    on_session = turn({"messages": [{"role": "user", "content": "three"}]}, session)
    counted = await counted_request(counting, on_session, OWNER, BETA)
    contents = [message["content"] for message in orjson.loads(counted.body)["messages"]]
    assert contents == ["one", [{"type": "text", "text": "r1"}], "two", [{"type": "text", "text": "r2"}], "three"]


async def test_a_count_from_an_id_continued_meanwhile_is_refused_as_its_continue_would_be(
    service: ThreadService, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = await service.begin(create("one"), OWNER)
    await service.commit(first, reply("r1"))
    counting = _overtaking(service, monkeypatch, first.response_id)
    with pytest.raises(ThreadAlreadyContinued):
        await counted_request(counting, cont(first.response_id, "three"), OWNER, BETA)
