"""The Responses front door on real processes: statestore on PostgreSQL and Redis, in front of the fake backend's
strict Chat Completions endpoint (tests/support/fake_backend.py), driven by the official `openai` SDK."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import AsyncIterator, Iterator
from typing import Any

import openai
import orjson
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from tests.support import tls
from tests.support.fake_backend import FakeBackend, RecordedRequest
from tests.support.redis_keys import own_redis_prefix
from tests.support.server import OWNER_SECRET, StatestoreServer

ADMIN_TOKEN = "responses-admin-token-0123456789"
CHAT_PATH = "/v1/chat/completions"


# A function tool as the openai SDK sends it.
WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": True,
}


@pytest.fixture(scope="session")
async def responses_pg_url(postgres_admin_url: str) -> AsyncIterator[str]:
    """A database of these tests' own: row counts by owner and the stats are theirs alone."""
    from tests.conftest import migrated_scratch_pg_database

    async with migrated_scratch_pg_database(postgres_admin_url) as url:
        yield url


@pytest.fixture(scope="session")
def responses_redis_prefix(redis_url: str) -> Iterator[str]:
    with own_redis_prefix(redis_url) as prefix:
        yield prefix


@pytest.fixture(scope="session")
def responses_server(
    responses_pg_url: str, redis_url: str, responses_redis_prefix: str, fake_backend_process: FakeBackend
) -> Iterator[StatestoreServer]:
    server = StatestoreServer(
        database_url=responses_pg_url,
        upstream_url=fake_backend_process.url,
        redis_url=redis_url,
        redis_prefix=responses_redis_prefix,
        env={
            "STATESTORE_CHAT_UPSTREAM_URL": fake_backend_process.url,
            "STATESTORE_ADMIN_TOKENS": f"ops:{ADMIN_TOKEN}",
            "STATESTORE_LEASE_SECONDS": "30",
        },
    )
    yield server
    server.stop()


@pytest.fixture(scope="session")
def responses_sqlite_server(
    tmp_path_factory: pytest.TempPathFactory, fake_backend_process: FakeBackend
) -> Iterator[StatestoreServer]:
    """The embedded default: a SQLite file and the in-process cache."""
    from statestore.store.migrate import upgrade

    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('responses-sqlite') / 'statestore.db'}"
    upgrade(url)
    server = StatestoreServer(
        database_url=url,
        upstream_url=fake_backend_process.url,
        env={"STATESTORE_CHAT_UPSTREAM_URL": fake_backend_process.url},
    )
    yield server
    server.stop()


@pytest.fixture(params=["postgres", "sqlite"])
def any_openai_client(request: pytest.FixtureRequest, api_key: str) -> Iterator[openai.OpenAI]:
    """The SDK against statestore on each storage set-up."""
    name = "responses_server" if request.param == "postgres" else "responses_sqlite_server"
    server: StatestoreServer = request.getfixturevalue(name)
    http = openai.DefaultHttpxClient(verify=tls.CONTEXT)
    with openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, http_client=http) as client:
        yield client


@pytest.fixture
def openai_client(responses_server: StatestoreServer, api_key: str) -> Iterator[openai.OpenAI]:
    http = openai.DefaultHttpxClient(verify=tls.CONTEXT)
    url = responses_server.url + "/v1"
    with openai.OpenAI(base_url=url, api_key=api_key, max_retries=0, http_client=http) as client:
        yield client


@pytest.fixture
async def async_openai_client(responses_server: StatestoreServer, api_key: str) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=responses_server.url + "/v1", api_key=api_key, max_retries=0) as client:
        yield client


def owner_of(api_key: str) -> str:
    """The owner statestore derives from a passthrough credential (statestore/auth.py)."""
    return "p:" + hmac.new(OWNER_SECRET.encode(), api_key.encode(), hashlib.sha256).hexdigest()[:48]


class Rows:
    """What an owner has stored, read straight from the database."""

    def __init__(self, url: str) -> None:
        self.url = url

    async def counts(self, api_key: str) -> dict[str, int]:
        engine = create_async_engine(self.url, poolclass=NullPool)
        owner = owner_of(api_key)
        try:
            async with engine.connect() as conn:
                responses = (
                    await conn.execute(text("SELECT count(*) FROM responses WHERE owner = :o"), {"o": owner})
                ).scalar_one()
                items = (
                    await conn.execute(
                        text(
                            "SELECT count(*) FROM response_items i JOIN responses r ON r.id = i.response_id "
                            "WHERE r.owner = :o"
                        ),
                        {"o": owner},
                    )
                ).scalar_one()
                conversation_items = (
                    await conn.execute(
                        text(
                            "SELECT count(*) FROM conversation_items i "
                            "JOIN conversations c ON c.id = i.conversation_id WHERE c.owner = :o"
                        ),
                        {"o": owner},
                    )
                ).scalar_one()
        finally:
            await engine.dispose()
        return {"responses": responses, "response_items": items, "conversation_items": conversation_items}


@pytest.fixture
def rows(responses_pg_url: str) -> Rows:
    return Rows(responses_pg_url)


def chat_requests(backend: FakeBackend) -> list[dict[str, Any]]:
    """The Chat Completions requests the backend received, parsed."""
    return [orjson.loads(r.body) for r in backend.requests() if r.path == CHAT_PATH]


def last_chat_request(backend: FakeBackend) -> RecordedRequest:
    return [r for r in backend.requests() if r.path == CHAT_PATH][-1]


def other_key() -> str:
    return f"sk-other-{secrets.token_hex(8)}"


def texts(items: Any) -> list[str]:
    """The first content part's text of each item (the SDK's item types are wide unions)."""
    return [str(item.model_dump()["content"][0]["text"]) for item in items]


def id_of(item: Any) -> str:
    return str(item.id)
