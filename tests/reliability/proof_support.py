"""Helpers of the reliability and security proofs (test_hostile_input, test_openapi_fuzz, test_concurrency,
test_security): a migrated PostgreSQL database of a module's own, statestore processes on it, a direct probe of what
the database holds, and the check that an error response has Anthropic's shape.

Each module keeps its own database and Redis prefix: admin requests there change the default retention policy, and
"nothing was stored" is proven by row counts that only that module's requests can move.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import ExitStack, asynccontextmanager, contextmanager
from typing import Any

import httpx
import orjson
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from statestore.store.schema import api_keys, audit_log, policies, sessions, tenants, thread_messages, threads
from tests.conftest import migrated_scratch_pg_database
from tests.support.fake_backend import FakeBackend
from tests.support.redis_keys import own_redis_prefix
from tests.support.server import StatestoreServer

THREADS_BETA = "message-threads-2026-08-12"
MODEL = "claude-test"
# 16+ characters, as STATESTORE_ADMIN_TOKENS requires.
ADMIN_TOKEN = "adm-" + "Q7v" * 8
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}

# What each status of statestore's own errors is called in `error.type` (docs/protocol.md §4).
ERROR_TYPES = {
    400: {"invalid_request_error"},
    401: {"authentication_error"},
    403: {"permission_error"},
    404: {"not_found_error"},
    405: {"invalid_request_error"},
    409: {"invalid_request_error"},
    413: {"request_too_large"},
}

COUNTED_TABLES = {
    "threads": threads,
    "thread_messages": thread_messages,
    "sessions": sessions,
    "tenants": tenants,
    "api_keys": api_keys,
    "policies": policies,
    "audit_log": audit_log,
}


def new_key() -> str:
    """A passthrough credential of its own: a new owner."""
    return f"sk-rel-{secrets.token_hex(10)}"


def thread_headers(api_key: str, **extra: str) -> dict[str, str]:
    return {
        "x-api-key": api_key,
        "anthropic-version": "2023-06-01",
        "anthropic-beta": THREADS_BETA,
        "content-type": "application/json",
        **extra,
    }


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def create_body(messages: Sequence[Mapping[str, Any]], **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 64, **fields, "thread": {"type": "create"}, "messages": list(messages)}


def continue_body(previous_id: str, messages: Sequence[Mapping[str, Any]], **fields: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 64,
        **fields,
        "thread": {"type": "continue", "previous_message_id": previous_id},
        "messages": list(messages),
    }


def check_error_shape(
    status: int, headers: Mapping[str, str], content: bytes, *, statestore_made: bool = True
) -> dict[str, Any]:
    """Problems with an error response, as a list in `["problems"]`, and its parsed `error` object in `["error"]`.

    The shape is docs/protocol.md §4: `{"type": "error", "error": {"type", "message", ...}, "request_id": "req_…"}` with
    a `request-id` header equal to `request_id`. With `statestore_made`, `error.type` must also be the one statestore
    uses for that status (a relayed backend error keeps the backend's)."""
    problems: list[str] = []
    content_type = headers.get("content-type", "")
    if not content_type.startswith("application/json"):
        problems.append(f"content-type {content_type!r}")
    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError:
        return {"problems": [*problems, f"body is not JSON: {content[:200]!r}"], "error": {}}
    if not isinstance(body, dict) or body.get("type") != "error" or not isinstance(body.get("error"), dict):
        return {"problems": [*problems, f"not an error body: {content[:200]!r}"], "error": {}}
    error: dict[str, Any] = body["error"]
    if not isinstance(error.get("type"), str) or not isinstance(error.get("message"), str) or not error["message"]:
        problems.append(f"error.type/error.message missing: {error!r}")
    request_id = body.get("request_id")
    if not isinstance(request_id, str) or not request_id.startswith("req_"):
        problems.append(f"request_id {request_id!r}")
    if headers.get("request-id") != request_id:
        problems.append(f"request-id header {headers.get('request-id')!r} != body request_id {request_id!r}")
    if statestore_made and status in ERROR_TYPES and error.get("type") not in ERROR_TYPES[status]:
        problems.append(f"error.type {error.get('type')!r} for status {status}")
    return {"problems": problems, "error": error}


def assert_client_error(
    response: httpx.Response, status: int | None = None, *, statestore_made: bool = True
) -> dict[str, Any]:
    """A 4xx (never a 5xx) in Anthropic's error shape; returns its `error` object."""
    where = f"{response.request.method} {response.request.url.path}"
    assert 400 <= response.status_code < 500, f"{where}: {response.status_code} {response.text[:500]}"
    if status is not None:
        assert response.status_code == status, f"{where}: {response.status_code} {response.text[:500]}"
    checked = check_error_shape(
        response.status_code, response.headers, response.content, statestore_made=statestore_made
    )
    assert not checked["problems"], f"{where}: {checked['problems']}"
    error: dict[str, Any] = checked["error"]
    return error


class Database:
    """Direct reads of a statestore database, for what the API does not show (headless rows, leases, positions)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine: AsyncEngine = create_async_engine(url, poolclass=NullPool, connect_args={"timeout": 5})

    async def counts(self) -> dict[str, int]:
        async with self.engine.connect() as conn:
            return {
                name: int((await conn.execute(select(func.count()).select_from(table))).scalar_one())
                for name, table in COUNTED_TABLES.items()
            }

    async def thread_rows(self, thread_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """id → {head_message_id, head_position, lease_token, positions: [...], response_ids: [...]}."""
        async with self.engine.connect() as conn:
            heads = (
                await conn.execute(
                    select(
                        threads.c.id, threads.c.head_message_id, threads.c.head_position, threads.c.lease_token
                    ).where(threads.c.id.in_(list(thread_ids)))
                )
            ).all()
            rows = (
                await conn.execute(
                    select(thread_messages.c.thread_id, thread_messages.c.position, thread_messages.c.response_id)
                    .where(thread_messages.c.thread_id.in_(list(thread_ids)))
                    .order_by(thread_messages.c.thread_id, thread_messages.c.position)
                )
            ).all()
        found: dict[str, dict[str, Any]] = {
            head.id: {
                "head_message_id": head.head_message_id,
                "head_position": head.head_position,
                "lease_token": head.lease_token,
                "positions": [],
                "response_ids": [],
            }
            for head in heads
        }
        for row in rows:
            found[row.thread_id]["positions"].append(row.position)
            found[row.thread_id]["response_ids"].append(row.response_id)
        return found

    async def column_values(self, table_name: str) -> list[tuple[Any, ...]]:
        async with self.engine.connect() as conn:
            return [tuple(row) for row in (await conn.execute(select(COUNTED_TABLES[table_name]))).all()]

    async def dispose(self) -> None:
        await self.engine.dispose()


@asynccontextmanager
async def private_database(postgres_admin_url: str) -> AsyncIterator[Database]:
    """A new database migrated to head, dropped afterwards."""

    async with migrated_scratch_pg_database(postgres_admin_url) as url:
        database = Database(url)
        try:
            yield database
        finally:
            await database.dispose()


class Servers:
    """statestore processes on one database and Redis prefix, all stopped when the block ends."""

    def __init__(self, stack: ExitStack, *, database_url: str, redis_url: str, prefix: str, backend: FakeBackend):
        self._stack = stack
        self.database_url = database_url
        self.redis_url = redis_url
        self.prefix = prefix
        self.backend = backend

    def start(self, **env: str) -> StatestoreServer:
        """A server with these extra settings; `STATESTORE_ADMIN_TOKENS` is `root:<ADMIN_TOKEN>` unless given."""
        server = StatestoreServer(
            database_url=self.database_url,
            upstream_url=self.backend.url,
            redis_url=self.redis_url,
            redis_prefix=self.prefix,
            env={"STATESTORE_ADMIN_TOKENS": f"root:{ADMIN_TOKEN}", **env},
        )
        self._stack.callback(server.stop)
        return server


@contextmanager
def servers_on(database: Database, redis_url: str, backend: FakeBackend) -> Iterator[Servers]:
    with ExitStack() as stack:
        prefix = stack.enter_context(own_redis_prefix(redis_url))
        yield Servers(stack, database_url=database.url, redis_url=redis_url, prefix=prefix, backend=backend)
