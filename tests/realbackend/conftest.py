"""The real-backend suite: statestore (PostgreSQL + Redis) in front of llama.cpp's llama-server, driven by the official
SDKs. Every test here is marked `real_backend` (`make test-real` runs only these). Two backends: one with a 4,096-token
window for the doors' ordinary turns, one with a 2,048-token window for long conversations and refusals."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import anthropic
import openai
import pytest

from tests.realbackend.llama import Artifacts, LlamaServer, build
from tests.support.admin_api import ADMIN_TOKENS, AdminApi, policy
from tests.support.redis_keys import own_redis_prefix
from tests.support.server import StatestoreServer

HERE = Path(__file__).resolve().parent
WIDE = 4096
NARROW = 2048


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.real_backend)


@dataclass
class Stack:
    """One llama-server and the statestore in front of it, on a database and Redis prefix of their own."""

    llama: LlamaServer
    statestore: StatestoreServer

    def set_policy(self, **values: object) -> None:
        with AdminApi(self.statestore.url) as admin:
            admin.ok("PUT", "/policies/default", policy(**values))


@pytest.fixture(scope="session")
def artifacts() -> Artifacts:
    return build()


async def _database(postgres_admin_url: str) -> AsyncIterator[str]:
    from tests.conftest import migrated_scratch_pg_database

    async with migrated_scratch_pg_database(postgres_admin_url) as url:
        yield url


@pytest.fixture(scope="session")
async def wide_db(postgres_admin_url: str) -> AsyncIterator[str]:
    async for url in _database(postgres_admin_url):
        yield url


@pytest.fixture(scope="session")
async def narrow_db(postgres_admin_url: str) -> AsyncIterator[str]:
    async for url in _database(postgres_admin_url):
        yield url


def _stack(artifacts: Artifacts, context: int, database_url: str, redis_url: str, tmp: Path) -> Iterator[Stack]:
    llama = LlamaServer(artifacts, context=context, log_dir=tmp)
    try:
        with own_redis_prefix(redis_url) as prefix:
            server = StatestoreServer(
                database_url=database_url,
                upstream_url=llama.url,
                redis_url=redis_url,
                redis_prefix=prefix,
                env={
                    "STATESTORE_ADMIN_TOKENS": ADMIN_TOKENS,
                    "STATESTORE_UPSTREAM_READ_TIMEOUT": "120",
                    "STATESTORE_CHAT_UPSTREAM_URL": llama.url,
                },
            )
            try:
                yield Stack(llama, server)
            finally:
                server.stop()
    finally:
        llama.stop()


@pytest.fixture(scope="session")
def wide(
    artifacts: Artifacts, wide_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    yield from _stack(artifacts, WIDE, wide_db, redis_url, tmp_path_factory.mktemp("wide"))


@pytest.fixture(scope="session")
def narrow(
    artifacts: Artifacts, narrow_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    yield from _stack(artifacts, NARROW, narrow_db, redis_url, tmp_path_factory.mktemp("narrow"))


@pytest.fixture
def stack(wide: Stack) -> Iterator[Stack]:
    """The wide stack, its default policy put back after the test."""
    yield wide
    wide.set_policy()


@pytest.fixture
def narrow_stack(narrow: Stack) -> Iterator[Stack]:
    yield narrow
    narrow.set_policy()


@pytest.fixture
def api_key() -> str:
    return f"sk-real-{secrets.token_hex(8)}"


@pytest.fixture
def claude(stack: Stack, api_key: str) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=stack.statestore.url, api_key=api_key, max_retries=0, timeout=120) as sdk:
        yield sdk


@pytest.fixture
def direct_claude(stack: Stack, api_key: str) -> Iterator[anthropic.Anthropic]:
    """The same SDK straight to llama-server, for comparison."""
    with anthropic.Anthropic(base_url=stack.llama.url, api_key=api_key, max_retries=0, timeout=120) as sdk:
        yield sdk


@pytest.fixture
def gpt(stack: Stack, api_key: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=stack.statestore.url + "/v1", api_key=api_key, max_retries=0, timeout=120) as sdk:
        yield sdk
