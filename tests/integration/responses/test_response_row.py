"""A response's read (store/response_store.py get) fills each field of its ResponseRow from the column named for it,
on PostgreSQL (asyncpg's GET_RESPONSE) and on SQLite (the SQLAlchemy select): every column holds a value no other
column holds, so two fields swapped by either read fail here, and a read's columns taken by name cannot be swapped by
listing them in another order."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import insert

from statestore.store.engine import create_engine
from statestore.store.pg_hot_path import PgHotPath, asyncpg_dsn
from statestore.store.pg_pool import LeanPool
from statestore.store.response_records import READ_COLUMNS, ResponseRow, read_row
from statestore.store.response_statements import PgResponseStatements
from statestore.store.response_store import ResponseStore
from statestore.store.schema import conversations, responses
from tests.conftest import migrated_scratch_pg_database

OWNER = "t:rowread"
NOW = 1_700_000_000_000


@pytest.fixture(params=["postgres", "sqlite"])
async def database(
    request: pytest.FixtureRequest, migrated_sqlite_url: str, postgres_admin_url: str
) -> AsyncIterator[str]:
    if request.param == "sqlite":
        yield migrated_sqlite_url
        return
    async with migrated_scratch_pg_database(postgres_admin_url) as url:
        yield url


def _response(id_: str, **values: object) -> dict[str, object]:
    row: dict[str, object] = {
        "id": id_,
        "owner": OWNER,
        "root_id": id_,
        "depth": 0,
        "chain_bytes": 1,
        "body": b"{}",
        "created_ms": NOW,
        "expires_ms": NOW + 1_000_000,
    }
    return row | values


async def _read(url: str, response_id: str) -> ResponseRow | None:
    engine = create_engine(url)
    pg: PgHotPath | None = None
    try:
        if url.startswith("sqlite"):
            store = ResponseStore(engine)
        else:
            dsn = asyncpg_dsn(url)
            settings = {"application_name": "statestore-test"}
            pg = PgHotPath(LeanPool(dsn, max_size=1, timeout=10, server_settings=settings))
            store = ResponseStore(engine, PgResponseStatements(pg))
        return await store.get(OWNER, response_id, now_ms=NOW)
    finally:
        if pg is not None:
            await pg.aclose()
        await engine.dispose()


async def test_each_field_of_a_read_response_comes_from_its_own_column(database: str) -> None:
    engine = create_engine(database)
    try:
        async with engine.begin() as conn:
            await conn.execute(
                insert(conversations).values(
                    id="conv_row", owner=OWNER, metadata=b"{}", next_position=17, created_ms=NOW, expires_ms=NOW + 9
                )
            )
            await conn.execute(insert(responses).values(_response("resp_root", conversation_id="conv_row")))
            await conn.execute(
                insert(responses).values(
                    _response("resp_holder", root_id="resp_root", depth=1, context_head=b"the summary")
                )
            )
            await conn.execute(
                insert(responses).values(
                    _response(
                        "resp_read",
                        root_id="resp_root",
                        parent_id="resp_holder",
                        depth=5,
                        chain_bytes=1234,
                        body=b'{"id":"resp_read"}',
                        context_tokens=301,
                        context_bytes=4022,
                        context_kept=77,
                        context_head_id="resp_holder",
                        context_runs=b"\x01\x02runs",
                        expires_ms=NOW + 555_555,
                    )
                )
            )
    finally:
        await engine.dispose()

    row = await _read(database, "resp_read")
    assert row == ResponseRow(
        id="resp_read",
        root_id="resp_root",
        depth=5,
        chain_bytes=1234,
        body=b'{"id":"resp_read"}',
        conversation_version=17,
        context_tokens=301,
        context_bytes=4022,
        context_kept=77,
        context_head_id="resp_holder",
        context_head=b"the summary",
        context_runs=b"\x01\x02runs",
        expires_ms=NOW + 555_555,
        owner=OWNER,
    )
    # The columns read as NULL take their defaults: no version off a conversation, no counts stored.
    alone = await _read(database, "resp_holder")
    assert alone is not None
    assert (alone.conversation_version, alone.context_tokens, alone.context_bytes) == (17, 0, 0)


def test_a_read_row_is_taken_by_name_whatever_the_order_of_its_columns() -> None:
    values = {name: f"value of {name}" for name in READ_COLUMNS}
    forwards = read_row(values, "t:a")
    backwards = read_row(dict(reversed(list(values.items()))), "t:a")
    assert forwards == backwards
    assert {name: getattr(forwards, name) for name in READ_COLUMNS} == values
    assert forwards.owner == "t:a"
    assert {f.name for f in dataclasses.fields(ResponseRow)} == {*READ_COLUMNS, "owner"}
    with pytest.raises(KeyError):
        read_row({name: 0 for name in READ_COLUMNS if name != "context_kept"}, "t:a")
