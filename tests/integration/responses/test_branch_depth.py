"""A branch (a continue from a response that is not its chain's head: regenerate, edit) at depth, on PostgreSQL and
SQLite: it rebuilds exactly the items of its path from the database (store/response_runs.py), deletions, erasure
and expiry on the way included, and its read does not grow with the depth beyond the items it sends."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import asyncpg
import openai
import pytest
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

from statestore.store.engine import create_engine
from statestore.store.pg_hot_path import PgHotPath, asyncpg_dsn
from statestore.store.pg_pool import LeanPool
from statestore.store.response_records import ResponseRow
from statestore.store.response_statements import PgResponseStatements
from statestore.store.response_store import ResponseStore
from statestore.store.schema import response_items, responses
from statestore.store.statement import P, PgStatement
from tests.integration.responses.conftest import last_chat_request, owner_of
from tests.support.admin_api import ADMIN_TOKENS, AdminApi, ClockFile
from tests.support.fake_backend import FakeBackend
from tests.support.server import StatestoreServer

DEPTH = 50


@pytest.fixture(scope="module", params=["postgres", "sqlite"])
def storage(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The database URL of each storage set-up (a migrated database of this module's own)."""
    if request.param == "postgres":
        url: str = request.getfixturevalue("module_db")
        return url
    from statestore.store.migrate import upgrade

    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('branch-depth') / 'statestore.db'}"
    upgrade(url)
    return url


@pytest.fixture(scope="module")
def server(
    storage: str, redis_url: str, module_prefix: str, clock: ClockFile, fake_backend_process: FakeBackend
) -> Iterator[StatestoreServer]:
    on_postgres = storage.startswith("postgresql")
    running = StatestoreServer(
        database_url=storage,
        upstream_url=fake_backend_process.url,
        redis_url=redis_url if on_postgres else None,
        redis_prefix=module_prefix,
        env={
            "STATESTORE_CHAT_UPSTREAM_URL": fake_backend_process.url,
            "STATESTORE_ADMIN_TOKENS": ADMIN_TOKENS,
            "STATESTORE_CLOCK_OFFSET_FILE": str(clock.path),
            "STATESTORE_DEFAULT_TTL_SECONDS": "60",
            "STATESTORE_MAX_TTL_SECONDS": "300",
            "STATESTORE_PURGE_INTERVAL_SECONDS": "3600",
        },
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def admin(server: StatestoreServer) -> Iterator[AdminApi]:
    with AdminApi(server.url) as api:
        yield api


@pytest.fixture
def client(server: StatestoreServer, api_key: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0) as sdk:
        yield sdk


def said(turn: str) -> list[dict[str, str]]:
    """The messages of a turn the echo backend answered."""
    return [{"role": "user", "content": turn}, {"role": "assistant", "content": f"echo: {turn}"}]


def chain(client: openai.OpenAI, turns: list[str], previous: str | None = None, **fields: Any) -> list[str]:
    ids = []
    for turn in turns:
        previous = client.responses.create(model="echo-1", input=turn, previous_response_id=previous, **fields).id
        ids.append(previous)
    return ids


def sent(client: openai.OpenAI, backend: FakeBackend, previous: str, turn: str) -> tuple[str, list[Any]]:
    """Continue `previous` with `turn`: the new response's id and the messages the backend received."""
    backend.reset()
    made = client.responses.create(model="echo-1", input=turn, previous_response_id=previous)
    return made.id, last_chat_request(backend).json()["messages"]


def turns(prefix: str, count: int) -> list[str]:
    return [f'{prefix} {n} ✓ "q"' for n in range(count)]


def expected(said_turns: list[str], new: str) -> list[dict[str, str]]:
    return [message for turn in said_turns for message in said(turn)] + [{"role": "user", "content": new}]


def test_branches_at_depth_from_the_head_the_middle_and_the_root(client: openai.OpenAI, backend: FakeBackend) -> None:
    main = turns("main", DEPTH)
    ids = chain(client, main)
    # The head's context is cached; continuing the head moves that entry on, so a second continue from the head is
    # a branch read from the database, and so is every continue from an older response.
    _, first = sent(client, backend, ids[-1], "again")
    assert first == expected(main, "again")
    for at in (DEPTH - 1, DEPTH - 1, DEPTH // 2, 0):
        _, messages = sent(client, backend, ids[at], f"branch at {at}")
        assert messages == expected(main[: at + 1], f"branch at {at}")
    # A branch of a branch, deep in: each run along the path contributes its prefix, in order.
    middle = chain(client, turns("middle", 10), ids[DEPTH // 2])
    deeper = chain(client, turns("deeper", 5), middle[4])
    path = main[: DEPTH // 2 + 1] + turns("middle", 5) + turns("deeper", 5)
    for at, head in ((3, deeper[3]), (4, deeper[4])):
        _, messages = sent(client, backend, head, "regenerate")
        assert messages == expected(path[: len(path) - 4 + at], "regenerate")
    _, messages = sent(client, backend, middle[9], "the middle's head")
    assert messages == expected(main[: DEPTH // 2 + 1] + turns("middle", 10), "the middle's head")


def test_a_deleted_response_on_the_way_fails_every_branch_below_it_and_no_other(
    client: openai.OpenAI, backend: FakeBackend
) -> None:
    main = turns("kept", DEPTH)
    ids = chain(client, main)
    side = chain(client, turns("side", 3), ids[10])
    client.responses.delete(ids[30])
    for below in (ids[31], ids[40], ids[-1]):
        with pytest.raises(openai.BadRequestError):
            client.responses.create(model="echo-1", input="x", previous_response_id=below)
    for at in (29, 10, 0):
        _, messages = sent(client, backend, ids[at], "above")
        assert messages == expected(main[: at + 1], "above")
    _, messages = sent(client, backend, side[2], "side")
    assert messages == expected(main[:11] + turns("side", 3), "side")


def test_a_branch_point_is_kept_for_the_next_branch_and_goes_with_a_deleted_ancestor(
    client: openai.OpenAI, backend: FakeBackend, storage: str, redis_url: str, module_prefix: str
) -> None:
    """The first branch from a response reads its context from the database and keeps it as that response's
    branch point; the branches after it read that entry (the same bytes), and a deletion above it drops it."""
    main = turns("point", 12)
    ids = chain(client, main)
    for again in range(3):  # the first reads the database, the next ones the branch point: the same context
        _, messages = sent(client, backend, ids[8], f"regenerate {again}")
        assert messages == expected(main[:9], f"regenerate {again}")
    if storage.startswith("postgresql"):
        import redis

        entry = redis.Redis.from_url(redis_url).get(f"{module_prefix}{{resp:{ids[8]}}}:n")
        assert entry == b"2:9:-2"  # nine segments, kept for branches
    _, messages = sent(client, backend, ids[-1], "the head goes on")
    assert messages == expected(main, "the head goes on")
    client.responses.delete(ids[5])
    for below in (ids[8], ids[9]):
        with pytest.raises(openai.BadRequestError):
            client.responses.create(model="echo-1", input="x", previous_response_id=below)
    _, messages = sent(client, backend, ids[4], "above")
    assert messages == expected(main[:5], "above")


def test_a_run_continued_again_after_a_deletion_does_not_lend_its_items_to_an_old_branch(
    client: openai.OpenAI, backend: FakeBackend
) -> None:
    """The first child of `a[2]` continued a's run and was deleted with its own child: a later child of `a[2]`, of the
    same size, continues the run where they were. A branch below the deleted child must still fail, not read the
    newcomer's items in the deleted one's place."""
    a = chain(client, turns("a", 3))
    gone = chain(client, ["gone 1"], a[2])[0]
    gone_child = chain(client, ["gone 2"], gone)[0]
    orphan = chain(client, ["orphan"], gone)[0]  # a branch: a run of its own below `gone`
    client.responses.delete(gone_child)
    client.responses.delete(gone)
    newcomer = chain(client, ["gone 9"], a[2])[0]
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="echo-1", input="x", previous_response_id=orphan)
    _, messages = sent(client, backend, newcomer, "on")
    assert messages == expected([*turns("a", 3), "gone 9"], "on")


def test_concurrent_children_of_one_response_each_rebuild_their_own_path(
    server: StatestoreServer, api_key: str, backend: FakeBackend
) -> None:
    """Children made at once may both take their parent's run: each still rebuilds exactly its own path."""

    async def race() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0) as sdk:
            root = await sdk.responses.create(model="echo-1", input="root")
            made = await asyncio.gather(
                *(
                    sdk.responses.create(model="echo-1", input=f"child {n}", previous_response_id=root.id)
                    for n in range(6)
                )
            )
            return [m.id for m in made]

    children = asyncio.run(race())
    with openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0) as client:
        for n, child in enumerate(children):
            for again in range(2):  # the second continue of a child is a branch, read from the database
                _, messages = sent(client, backend, child, f"after {n}")
                assert messages == expected(["root", f"child {n}"], f"after {n}"), again


def test_erasure_of_a_user_id_takes_its_trees_and_leaves_other_branches_whole(
    client: openai.OpenAI, admin: AdminApi, backend: FakeBackend
) -> None:
    user = f"user-branch-{id(client)}"
    theirs = chain(client, turns("theirs", 20))
    mine = chain(client, ["mine"], theirs[9], metadata={"user_id": user})[0]
    other = chain(client, turns("other", 20))
    erased = admin.erase({"user_id": user})
    assert erased["erased_responses"] == 21  # the whole tree holding the user's response
    for gone in (theirs[5], theirs[-1], mine):
        with pytest.raises(openai.BadRequestError):
            client.responses.create(model="echo-1", input="x", previous_response_id=gone)
    _, messages = sent(client, backend, other[12], "still")
    assert messages == expected(turns("other", 13), "still")


def test_expiry_on_the_way(client: openai.OpenAI, admin: AdminApi, clock: ClockFile, backend: FakeBackend) -> None:
    """A tree is kept while any of its responses lives (docs/responses.md): a branch from a live response sends its
    expired ancestors' items, one from an expired response fails, and once every response has expired and the tree
    is purged, none comes back."""
    old = chain(client, turns("old", 10))
    clock.advance(40)
    newer = chain(client, turns("newer", 10), old[-1])
    clock.advance(30)  # `old` has expired, `newer` lives
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="echo-1", input="x", previous_response_id=old[5])
    admin.purge()
    _, messages = sent(client, backend, newer[4], "live")
    assert messages == expected(turns("old", 10) + turns("newer", 5), "live")
    clock.advance(301)
    admin.purge()
    for gone in (newer[4], newer[-1]):
        with pytest.raises(openai.BadRequestError):
            client.responses.create(model="echo-1", input="x", previous_response_id=gone)


# -- what a rebuild reads


class _Recording(PgHotPath):
    """The hot path, remembering each statement it ran and its bound values."""

    def __init__(self, pool: LeanPool) -> None:
        super().__init__(pool)
        self.ran: list[tuple[str, tuple[Any, ...]]] = []

    async def fetch(self, statement: PgStatement[P], params: P) -> list[asyncpg.Record]:
        self.ran.append((statement.sql, statement.bind(params)))
        return await super().fetch(statement, params)


def _rows_read(plan: dict[str, Any]) -> int:
    """The table and index rows a plan's scans read (kept or filtered out), over all their loops."""
    node = plan
    own = 0
    if "Scan" in node["Node Type"] and node["Node Type"] not in ("CTE Scan", "WorkTable Scan", "Function Scan"):
        loops = node.get("Actual Loops", 1)
        own = (node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)) * loops
    return own + sum(_rows_read(child) for child in node.get("Plans", []))


async def _pg_rebuild_reads(url: str, owner: str, head_id: str) -> tuple[int, int, int]:
    """(statements, rows read, items sent) of the database rebuild of `head_id`'s chain on PostgreSQL."""
    dsn = asyncpg_dsn(url)
    settings = {"application_name": "statestore-test"}
    pg = _Recording(LeanPool(dsn, max_size=1, timeout=10, server_settings=settings))
    engine = create_engine(url)
    try:
        store = ResponseStore(engine, PgResponseStatements(pg))
        head = await store.get(owner, head_id, now_ms=0)
        assert head is not None
        pg.ran.clear()
        segments = await store.chain_segments(head)
        assert segments is not None
        items = sum(len(segment) for segment in segments)
        connection = await asyncpg.connect(dsn)
        try:
            read = 0
            for sql, args in pg.ran:
                explained = await connection.fetchval("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, *args)
                read += _rows_read(json.loads(explained)[0]["Plan"])
        finally:
            await connection.close()
        return len(pg.ran), read, items
    finally:
        await pg.aclose()
        await engine.dispose()


async def _sqlite_rebuild_statements(url: str, owner: str, head_id: str) -> tuple[int, int]:
    """(statements, items sent) of the database rebuild of `head_id`'s chain on SQLite."""
    engine: AsyncEngine = create_engine(url)
    try:
        store = ResponseStore(engine)
        head: ResponseRow | None = await store.get(owner, head_id, now_ms=0)
        assert head is not None
        ran: list[str] = []
        event.listen(engine.sync_engine, "before_cursor_execute", lambda *args: ran.append(args[2]))
        segments = await store.chain_segments(head)
        assert segments is not None
        return len(ran), sum(len(segment) for segment in segments)
    finally:
        await engine.dispose()


def test_a_branch_at_depth_200_reads_what_one_at_depth_20_reads_beyond_its_items(
    client: openai.OpenAI, storage: str, api_key: str
) -> None:
    """The rebuild of a branch at depth 200 runs as many statements as at depth 20, and reads no more rows beyond the
    items it sends (PostgreSQL's own count of the rows its scans read)."""
    ids = chain(client, turns("deep", 201))
    # Branches from the chain (runs of their own) at depth 20 and 200, and the chain's responses there themselves.
    shallow = chain(client, ["at 20"], ids[19])[0]
    deep = chain(client, ["at 200"], ids[199])[0]
    owner = owner_of(api_key)
    if storage.startswith("postgresql"):
        for near, far in ((ids[20], ids[200]), (shallow, deep)):
            statements_near, read_near, items_near = asyncio.run(_pg_rebuild_reads(storage, owner, near))
            statements_far, read_far, items_far = asyncio.run(_pg_rebuild_reads(storage, owner, far))
            assert items_far > items_near
            assert statements_far == statements_near == 1
            assert read_far - items_far <= read_near - items_near
    else:
        for near, far in ((ids[20], ids[200]), (shallow, deep)):
            statements_near, items_near = asyncio.run(_sqlite_rebuild_statements(storage, owner, near))
            statements_far, items_far = asyncio.run(_sqlite_rebuild_statements(storage, owner, far))
            assert items_far > items_near
            assert statements_far == statements_near == 1


async def _as_older_code_wrote(url: str, response_id: str) -> None:
    """The response as code before revision 0013 stores it: no runs, its items in none."""
    engine = create_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.execute(responses.update().where(responses.c.id == response_id).values(context_runs=None))
            await conn.execute(
                response_items.update()
                .where(response_items.c.response_id == response_id)
                .values(run_id=None, run_position=None)
            )
    finally:
        await engine.dispose()


def test_responses_written_by_older_code_mid_chain_are_read_by_walking(
    client: openai.OpenAI, backend: FakeBackend, storage: str
) -> None:
    """A rolling upgrade: a response written by older code has no runs, so its descendants are walked, and its
    parent's run stays free past the parent for a newer child."""
    first = turns("new", 6)
    ids = chain(client, first)
    older = chain(client, ["older"], ids[-1])[0]
    asyncio.run(_as_older_code_wrote(storage, older))
    below = chain(client, turns("below", 3), older)
    for at, head in enumerate(below):
        _, messages = sent(client, backend, head, "again")
        assert messages == expected([*first, "older", *turns("below", at + 1)], "again")
    newer = chain(client, ["newer"], ids[-1])[0]
    _, messages = sent(client, backend, newer, "again")
    assert messages == expected([*first, "newer"], "again")
    _, messages = sent(client, backend, older, "again")
    assert messages == expected([*first, "older"], "again")
