"""The leased log (statestore/core/leased_log.py, its statements store/lease_statements.py) under both kinds of
conversation, on a migrated SQLite file and on PostgreSQL (its prepared statements): a lease is taken once, a held
log is not taken again until its lease runs out (why is asked apart), and a turn whose lease ran out and was taken
over finds it lost in the same way for a thread and for a conversation: renew and commit return False and store
nothing."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import pytest
from sqlalchemy import func, select

from statestore.config import Settings
from statestore.core.leased_log import CONVERSATIONS, THREADS, LeasedLog
from statestore.policy import Policy
from statestore.responses.conversation_append import append_items
from statestore.store.conversation_store import ConversationStore, Locked
from statestore.store.engine import create_engine
from statestore.store.lease_statements import LeaseStatements
from statestore.store.memory_cache import MemoryHistoryCache
from statestore.store.pg_hot_path import PgHotPath
from statestore.store.response_commit import AppendItems
from statestore.store.response_records import NewResponse, StoredItem
from statestore.store.response_runs import decode
from statestore.store.schema import responses
from statestore.store.thread_repository import ThreadRepository
from statestore.store.turn_records import LeasedThread, NewThread, TurnCommit

NOW = 1_000_000
LEASE_MS = 30_000
ITEM = StoredItem(item_id="msg_1", body=b'{"type":"message"}', kind="message", rendered=b'{"role":"user"}')


@dataclass
class Stores:
    log: LeasedLog
    threads: ThreadRepository
    conversations: ConversationStore
    statements: LeaseStatements


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest) -> str:
    url: str = request.getfixturevalue("migrated_sqlite_url" if request.param == "sqlite" else "migrated_pg_url")
    return url


@pytest.fixture
async def stores(database_url: str) -> AsyncIterator[Stores]:
    settings = Settings(database_url=database_url)
    engine = create_engine(settings)
    single = create_engine(settings, autocommit=True)
    pg = await PgHotPath.open(settings)
    statements = LeaseStatements(engine, single, pg)
    try:
        yield Stores(
            LeasedLog(statements), ThreadRepository(engine, single, pg=pg), ConversationStore(engine), statements
        )
    finally:
        if pg is not None:
            await pg.aclose()
        await single.dispose()
        await engine.dispose()


def _token() -> str:
    return secrets.token_hex(8)


async def _thread(stores: Stores, owner: str) -> tuple[str, str]:
    """A stored thread with one turn: its id and its head."""
    thread_id, token, head = f"thr_{_token()}", _token(), f"msg_{_token()}"
    new = NewThread(
        id=thread_id,
        owner=owner,
        tenant_id=None,
        session_id=None,
        metadata_user_id=None,
        system=None,
        tools=None,
        system_fp=None,
        tools_fp=None,
        output_config_fp=None,
        fixed_markers=0,
        ttl_seconds=300,
    )
    assert await stores.threads.begin_create(new, token=token, now_ms=NOW, lease_until_ms=NOW + LEASE_MS)
    assert await stores.log.commit_thread_turn(_turn(thread_id, token, head, start=0))
    return thread_id, head


def _turn(thread_id: str, token: str, head: str, *, start: int) -> TurnCommit:
    return TurnCommit(
        thread_id=thread_id,
        lease_token=token,
        start_position=start,
        rows=[(b'{"role":"user","content":"hi"}', None), (b'{"role":"assistant","content":"yo"}', head)],
        head_message_id=head,
        expires_ms=NOW + 300_000,
        ttl_seconds=300,
        now_ms=NOW,
        metadata_user_id=None,
    )


def _response(conversation_id: str, owner: str) -> NewResponse:
    return NewResponse(
        id=f"resp_{_token()}",
        owner=owner,
        tenant_id=None,
        metadata_user_id=None,
        parent=None,
        conversation_id=conversation_id,
        segment_bytes=len(ITEM.rendered),
        body=b"{}",
        created_ms=NOW,
        expires_ms=NOW + 300_000,
        inputs=[ITEM],
        outputs=[],
    )


async def _conversation(stores: Stores, owner: str) -> str:
    """A stored conversation with no items: its id."""
    conversation_id = f"conv_{_token()}"
    await stores.conversations.create(
        conversation_id=conversation_id,
        owner=owner,
        tenant_id=None,
        metadata_user_id=None,
        metadata=b"{}",
        items=[],
        now_ms=NOW,
        expires_ms=NOW + 300_000,
    )
    return conversation_id


async def test_a_lost_lease_is_the_same_for_a_thread_and_a_conversation(stores: Stores) -> None:
    owner = f"owner-{_token()}"
    thread_id, head = await _thread(stores, owner)
    conversation_id = await _conversation(stores, owner)
    first, second = _token(), _token()

    async def take_thread(token: str, now_ms: int) -> LeasedThread | None:
        return await stores.log.take_thread(
            owner=owner, thread_id=thread_id, head=head, token=token, now_ms=now_ms, until_ms=now_ms + 10
        )

    async def take_conversation(token: str, now_ms: int) -> tuple[int, int, int] | None:
        return await stores.log.take_conversation(
            owner=owner, conversation_id=conversation_id, token=token, now_ms=now_ms, until_ms=now_ms + 10
        )

    leased = await take_thread(first, NOW)
    assert leased is not None and leased.head_position == 2
    assert await take_conversation(first, NOW) == (0, 0, 0)
    # Held: neither is taken again while the lease runs.
    assert await take_thread(second, NOW + 1) is None
    assert await take_conversation(second, NOW + 1) is None
    # Why is asked apart: held, or no such log.
    assert (
        await stores.threads.why_not_continuable(owner=owner, thread_id=thread_id, response_id=head, now_ms=NOW + 1)
        == "in_flight"
    )
    assert isinstance(await stores.conversations.refusal(owner, conversation_id, NOW + 1), Locked)
    missing = await stores.conversations.refusal(owner, f"conv_{_token()}", NOW + 1)
    assert isinstance(missing, LookupError) and not isinstance(missing, Locked)
    assert await stores.log.renew(THREADS, thread_id, first, until_ms=NOW + 20)
    assert await stores.log.renew(CONVERSATIONS, conversation_id, first, until_ms=NOW + 20)
    # Run out and taken over: the first turn's lease is lost, in both, and its commit stores nothing.
    assert await take_thread(second, NOW + 21) is not None
    assert await take_conversation(second, NOW + 21) == (0, 0, 0)
    assert not await stores.log.renew(THREADS, thread_id, first, until_ms=NOW + 40)
    assert not await stores.log.renew(CONVERSATIONS, conversation_id, first, until_ms=NOW + 40)
    assert not await stores.log.commit_thread_turn(_turn(thread_id, first, f"msg_{_token()}", start=2))
    assert not await stores.log.commit_response(_response(conversation_id, owner), first)
    assert await stores.conversations.context_items(owner, conversation_id) == []
    # The holder commits; a release after that changes nothing.
    assert await stores.log.commit_thread_turn(_turn(thread_id, second, f"msg_{_token()}", start=2))
    assert await stores.log.commit_response(_response(conversation_id, owner), second)
    assert await stores.conversations.context_items(owner, conversation_id) == [("message", ITEM.rendered)]
    await stores.log.release(THREADS, thread_id, second)
    await stores.log.release(CONVERSATIONS, conversation_id, second)
    assert [position for position, _ in await stores.threads.load_context(thread_id, owner=owner)] == [0, 1, 2, 3]


async def test_a_released_lease_frees_the_log(stores: Stores) -> None:
    owner = f"owner-{_token()}"
    thread_id, head = await _thread(stores, owner)
    token = _token()
    take = {"owner": owner, "thread_id": thread_id, "head": head, "token": token}
    assert await stores.log.take_thread(**take, now_ms=NOW, until_ms=NOW + LEASE_MS) is not None
    await stores.log.release(THREADS, thread_id, token)
    assert await stores.log.take_thread(**take, now_ms=NOW, until_ms=NOW + LEASE_MS) is not None


async def test_a_chained_commit_stores_nothing_once_its_parent_is_gone(stores: Stores) -> None:
    """A chained turn whose parent was deleted while it ran (or was read from a cache entry its deletion could not
    drop) is not stored; one whose parent stands is, and returns the runs the database placed its items in."""
    owner = f"owner-{_token()}"
    root = dataclasses.replace(_response("unused", owner), conversation_id=None)
    parent = await stores.log.commit_response(root, None)
    assert parent is not None and parent.context_runs is not None
    child = dataclasses.replace(_response("unused", owner), conversation_id=None, parent=parent)
    extended = await stores.log.commit_response(child, None)
    # the child's items extend its parent's run: one run still
    assert extended is not None and extended.context_runs is not None
    assert len(decode(extended.context_runs).runs) == 1
    orphan_parent = dataclasses.replace(parent, id=f"resp_{_token()}")  # never stored, as if deleted
    orphan = dataclasses.replace(_response("unused", owner), conversation_id=None, parent=orphan_parent)
    assert await stores.log.commit_response(orphan, None) is None
    assert await _response_count(stores, owner) == 2


async def _response_count(stores: Stores, owner: str) -> int:
    async with stores.conversations.engine.connect() as conn:
        count: int = (
            await conn.execute(select(func.count()).select_from(responses).where(responses.c.owner == owner))
        ).scalar_one()
    return count


class _StalledAppends(LeasedLog):
    """A database that never answers an append's commit: the append holds its conversation meanwhile, as one whose
    replica died there would."""

    def __init__(self, statements: LeaseStatements) -> None:
        super().__init__(statements)
        self.reached = asyncio.Event()

    async def commit_append(self, append: AppendItems, items: Sequence[StoredItem]) -> bool:
        self.reached.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def test_an_append_holds_its_conversation_no_longer_than_a_turns_lease(stores: Stores) -> None:
    """Before: an append held the conversation for 30 s whatever STATESTORE_LEASE_SECONDS said, so with a short lease
    a retry after its replica died waited out the 30 s."""
    owner, lease_ms = f"owner-{_token()}", 2_000
    conversation_id = await _conversation(stores, owner)
    stalled = _StalledAppends(stores.statements)
    policy = Policy(
        threads_enabled=True,
        sessions_enabled=True,
        default_ttl_seconds=300,
        max_ttl_seconds=300,
        max_thread_bytes=1 << 30,
        max_messages=1_000,
    )
    append = asyncio.create_task(
        append_items(
            stalled,
            stores.conversations,
            owner,
            conversation_id,
            [ITEM],
            cache=MemoryHistoryCache(),
            policy=policy,
            now_ms=NOW,
            lease_ms=lease_ms,
        )
    )
    try:
        await asyncio.wait_for(stalled.reached.wait(), 10)
        assert isinstance(await stores.conversations.refusal(owner, conversation_id, NOW + lease_ms - 1), Locked)
        taken = await stores.log.take_conversation(
            owner=owner,
            conversation_id=conversation_id,
            token=_token(),
            now_ms=NOW + lease_ms,
            until_ms=NOW + 3 * lease_ms,
        )
        assert taken == (0, 0, 0)  # free once a turn's lease is out, and nothing of the stalled append stored
    finally:
        append.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await append
