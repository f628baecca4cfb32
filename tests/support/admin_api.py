"""Helpers for the owner, admin, thread-API and retention tests (docs/protocol.md §5, §7, §8): plain HTTP clients for an
owner and for an admin, the error shape, direct looks at the database and at Redis, the `statestore` CLI as a
subprocess, and the injectable clock.

Each test module that changes settings, policies or the clock runs its servers on a database of its own
(`migrated_database`), so nothing it does reaches the session's shared database or another module's servers.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar, cast

import httpx
import orjson
import redis
from anthropic.types.beta import BetaMessageParam
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from tests.conftest import migrated_scratch_pg_database
from tests.support import tls
from tests.support.server import OWNER_SECRET, REPO, StatestoreServer

THREADS_BETA = "message-threads-2026-08-12"
MODEL = "claude-test"
# Admin tokens of the servers these tests start: "name:token" entries; the name is the audit log's actor.
ADMIN_TOKEN = "adm-ops-0123456789abcdef"
AUDITOR_TOKEN = "adm-auditor-fedcba9876543210"
ADMIN_TOKENS = f"ops:{ADMIN_TOKEN},auditor:{AUDITOR_TOKEN}"
# keys mode: the backend credential statestore sends for every tenant without one of its own.
UPSTREAM_KEY = "sk-upstream-global-0123456789"

T = TypeVar("T")


def unique(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


def user(text: str) -> BetaMessageParam:
    return {"role": "user", "content": text}


def said(text: str) -> BetaMessageParam:
    """The assistant message the fake backend's default reply to `text` becomes in the history."""
    return cast(BetaMessageParam, {"role": "assistant", "content": [{"type": "text", "text": f"echo: {text}"}]})


def policy(**overrides: Any) -> dict[str, Any]:
    """A complete retention policy: the settings' defaults with `overrides`."""
    values: dict[str, Any] = {
        "threads_enabled": True,
        "sessions_enabled": True,
        "default_ttl_seconds": 300,
        "max_ttl_seconds": 86_400,
        "max_thread_bytes": 64 * 1024 * 1024,
        "max_messages": 100_000,
        "context_strategy": "none",
        "context_window_tokens": None,
        "context_trigger_ratio": 0.8,
        "context_target_ratio": 0.5,
        "summary_model": None,
        "summary_instructions": None,
        "max_background_turns": 16,
        "idempotency_ttl_seconds": 86400,
    }
    return {**values, **overrides}


def passthrough_owner(credential: str) -> str:
    """The owner a passthrough credential becomes (statestore.auth.PassthroughAuthenticator), for database checks."""
    digest = hmac.new(OWNER_SECRET.encode(), credential.encode(), hashlib.sha256).hexdigest()
    return "p:" + digest[:48]


# -- responses -----------------------------------------------------------------------------------------------------


def error_of(response: httpx.Response, status: int, error_type: str, error_code: str | None = None) -> dict[str, Any]:
    """The `error` object of an error response, checked against docs/protocol.md §4."""
    assert response.status_code == status, f"{response.status_code} != {status}: {response.text}"
    body = response.json()
    assert body["type"] == "error", body
    assert body["request_id"] == response.headers["request-id"]
    error: dict[str, Any] = body["error"]
    assert error["type"] == error_type, error
    assert error["message"]
    if error_code is None:
        assert "error_code" not in (error.get("details") or {}), error
    else:
        assert error["details"]["error_code"] == error_code, error
        assert response.headers["x-should-retry"] == "false"
    return error


def json_of(response: httpx.Response, status: int = 200) -> Any:
    assert response.status_code == status, f"{response.status_code} != {status}: {response.text}"
    return response.json()


def rfc3339(text: str) -> float:
    """Seconds since the epoch of an RFC 3339 time."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def granted_ttl(response: httpx.Response, *, now: float | None = None) -> float:
    """Seconds from `now` (the wall clock by default) to the reply's `statestore-expires-at`."""
    return rfc3339(response.headers["statestore-expires-at"]) - (time.time() if now is None else now)


def assert_about(value: float, expected: float, *, slack: float = 3.0) -> None:
    # `statestore-expires-at` has whole seconds, truncated; a test request takes well under a second.
    assert expected - slack <= value <= expected + 1.0, f"{value:.1f} is not about {expected}"


# -- an owner's HTTP client ------------------------------------------------------------------------------------------


class Api:
    """Plain HTTP to statestore as one credential (`x-api-key`, or `Authorization: Bearer` with `bearer=True`; no
    credential at all with `api_key=None`)."""

    def __init__(self, base_url: str, api_key: str | None, *, bearer: bool = False) -> None:
        headers = {"anthropic-version": "2023-06-01"}
        if api_key is not None:
            headers.update({"authorization": f"Bearer {api_key}"} if bearer else {"x-api-key": api_key})
        self.api_key = api_key
        self.http = httpx.Client(base_url=base_url, headers=headers, timeout=20, verify=tls.CONTEXT)

    def __enter__(self) -> Api:
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.close()

    def close(self) -> None:
        self.http.close()

    def post(
        self, body: Mapping[str, Any], *, headers: Mapping[str, str] | None = None, beta: bool = True
    ) -> httpx.Response:
        all_headers = {"content-type": "application/json", **({"anthropic-beta": THREADS_BETA} if beta else {})}
        return self.http.post("/v1/messages", content=orjson.dumps(body), headers={**all_headers, **(headers or {})})

    def stateless(self, text: str, **fields: Any) -> httpx.Response:
        return self.post({"model": MODEL, "max_tokens": 64, **fields, "messages": [user(text)]}, beta=False)

    def create(
        self,
        text: str | Sequence[Mapping[str, Any]],
        *,
        ttl: int | None = None,
        session: str | None = None,
        headers: Mapping[str, str] | None = None,
        **fields: Any,
    ) -> httpx.Response:
        messages = [user(text)] if isinstance(text, str) else list(text)
        body = {"model": MODEL, "max_tokens": 64, **fields, "messages": messages, "thread": {"type": "create"}}
        return self.post(body, headers=_turn_headers(headers, ttl=ttl, session=session))

    def continue_(
        self,
        previous_id: str,
        text: str | Sequence[Mapping[str, Any]],
        *,
        ttl: int | None = None,
        headers: Mapping[str, str] | None = None,
        **fields: Any,
    ) -> httpx.Response:
        messages = [user(text)] if isinstance(text, str) else list(text)
        body = {
            "model": MODEL,
            "max_tokens": 64,
            **fields,
            "messages": messages,
            "thread": {"type": "continue", "previous_message_id": previous_id},
        }
        return self.post(body, headers=_turn_headers(headers, ttl=ttl))

    def session(self, name: str, text: str, *, ttl: int | None = None, **fields: Any) -> httpx.Response:
        """A turn on a named session (no `thread` field)."""
        body = {"model": MODEL, "max_tokens": 64, **fields, "messages": [user(text)]}
        return self.post(body, headers=_turn_headers(None, ttl=ttl, session=name), beta=False)

    def threads(self, **params: Any) -> httpx.Response:
        return self.http.get("/statestore/v1/threads", params={k: v for k, v in params.items() if v is not None})

    def thread(self, thread_id: str) -> httpx.Response:
        return self.http.get(f"/statestore/v1/threads/{thread_id}")

    def export(self, thread_id: str) -> httpx.Response:
        return self.http.get(f"/statestore/v1/threads/{thread_id}/messages")

    def delete(self, thread_id: str) -> httpx.Response:
        return self.http.delete(f"/statestore/v1/threads/{thread_id}")

    def session_info(self, name: str) -> httpx.Response:
        return self.http.get(f"/statestore/v1/sessions/{name}")

    def models(self) -> httpx.Response:
        return self.http.get("/v1/models")

    def thread_ids(self) -> list[str]:
        """Every live thread id of this owner, newest first."""
        return [item["id"] for item in json_of(self.threads(limit=1000))["data"]]


def _turn_headers(headers: Mapping[str, str] | None, *, ttl: int | None, session: str | None = None) -> dict[str, str]:
    out = dict(headers or {})
    if ttl is not None:
        out["statestore-ttl"] = str(ttl)
    if session is not None:
        out["statestore-session-id"] = session
    return out


def created(response: httpx.Response) -> tuple[str, str]:
    """(thread id, response id) of a stored threaded reply."""
    assert response.status_code == 200, response.text
    thread_id = response.headers["statestore-thread-id"]
    if response.headers["content-type"].startswith("text/event-stream"):
        start = next(line for line in response.text.splitlines() if line.startswith('data: {"type":"message_start"'))
        message_id: str = orjson.loads(start.removeprefix("data: "))["message"]["id"]
        assert response.text.rstrip().endswith('data: {"type":"message_stop"}')
    else:
        message_id = response.json()["id"]
    assert message_id.startswith("msg_")
    return thread_id, message_id


# -- the admin API ---------------------------------------------------------------------------------------------------


def wait_for_erasure(http: httpx.Client, started: dict[str, Any], *, timeout: float = 60.0) -> dict[str, Any]:
    """An erasure (as POST /admin/v1/erase answered it) polled through `http` (an admin API client whose base URL is
    /admin/v1, or the server's with the admin token) until it is no longer running; it must end done."""
    assert started["status"] in ("running", "done"), started
    path = (
        f"/erasures/{started['id']}"
        if str(http.base_url).rstrip("/").endswith("/admin/v1")
        else (f"/admin/v1/erasures/{started['id']}")
    )
    deadline = time.monotonic() + timeout
    state = started
    while state["status"] == "running":
        assert time.monotonic() < deadline, f"erasure {started['id']} still running after {timeout} s"
        time.sleep(0.1)
        state = json_of(http.get(path), 200)
    assert state["status"] == "done", state
    return state


def erased_counts(state: dict[str, Any]) -> dict[str, int]:
    return {k: state[k] for k in ("erased_threads", "erased_responses", "erased_conversations")}


class AdminApi:
    def __init__(self, base_url: str, token: str = ADMIN_TOKEN) -> None:
        self.http = httpx.Client(
            base_url=base_url + "/admin/v1",
            headers={"authorization": f"Bearer {token}"},
            timeout=60,
            verify=tls.CONTEXT,
        )

    def __enter__(self) -> AdminApi:
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.close()

    def close(self) -> None:
        self.http.close()

    def call(self, method: str, path: str, body: Any = None, **params: Any) -> httpx.Response:
        content = orjson.dumps(body) if body is not None else None
        headers = {"content-type": "application/json"} if body is not None else {}
        return self.http.request(method, path, content=content, headers=headers, params=params or None)

    def ok(self, method: str, path: str, body: Any = None, *, status: int = 200, **params: Any) -> Any:
        return json_of(self.call(method, path, body, **params), status)

    def erase(self, body: Any, *, timeout: float = 60.0) -> dict[str, int]:
        """POST /erase, then poll its erasure until it is done: what it erased (erased_threads, erased_responses,
        erased_conversations)."""
        return erased_counts(wait_for_erasure(self.http, self.ok("POST", "/erase", body, status=202), timeout=timeout))

    def create_tenant(self, name: str | None = None) -> dict[str, Any]:
        tenant: dict[str, Any] = self.ok("POST", "/tenants", {"name": name or unique("tenant")}, status=201)
        return tenant

    def create_key(self, tenant: str, label: str | None = None) -> dict[str, Any]:
        key: dict[str, Any] = self.ok("POST", f"/tenants/{tenant}/keys", {"label": label}, status=201)
        return key

    def tenant_with_key(self, name: str | None = None) -> tuple[dict[str, Any], str]:
        tenant = self.create_tenant(name)
        return tenant, self.create_key(tenant["id"])["secret"]

    def put_policy(self, scope: str, **values: Any) -> dict[str, Any]:
        view: dict[str, Any] = self.ok("PUT", f"/policies/{scope}", policy(**values))
        return view

    def stats(self, tenant: str | None = None) -> dict[str, Any]:
        values: dict[str, Any] = (
            self.ok("GET", "/stats", tenant=tenant) if tenant is not None else self.ok("GET", "/stats")
        )
        return values

    def purge(self) -> int:
        count: int = self.ok("POST", "/purge")["purged_threads"]
        return count

    def audit(self, limit: int = 100) -> list[dict[str, Any]]:
        entries: list[dict[str, Any]] = self.ok("GET", "/audit", limit=limit)["data"]
        return entries


# -- databases -------------------------------------------------------------------------------------------------------


@asynccontextmanager
async def migrated_database(postgres_admin_url: str) -> AsyncIterator[str]:
    """A new PostgreSQL database at head for one test module; dropped afterwards."""
    async with migrated_scratch_pg_database(postgres_admin_url) as url:
        yield url


def run_async(make: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine to completion from a sync test, on a loop of its own in a thread of its own (the test session's
    loop is not to be disturbed)."""
    result: list[T] = []
    failure: list[BaseException] = []

    async def main() -> None:
        result.append(await make())

    def target() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:
            failure.append(exc)

    worker = threading.Thread(target=target)
    worker.start()
    worker.join()
    if failure:
        raise failure[0]
    return result[0]


class Database:
    """Direct SQL on a statestore PostgreSQL database, to see what the server left behind (asyncpg's `$1` parameters,
    through SQLAlchemy's driver-level calls)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def _run(self, query: str, args: Any) -> list[Sequence[Any]]:
        async def go() -> list[Sequence[Any]]:
            engine = create_async_engine(self.url, poolclass=NullPool)
            try:
                async with engine.begin() as conn:
                    result = await conn.exec_driver_sql(query, args)
                    return [tuple(row) for row in result.all()] if result.returns_rows else []
            finally:
                await engine.dispose()

        return run_async(go)

    def fetch(self, query: str, *args: Any) -> list[Sequence[Any]]:
        return self._run(query, tuple(args))

    def value(self, query: str, *args: Any) -> Any:
        rows = self.fetch(query, *args)
        return rows[0][0] if rows else None

    def execute_many(self, query: str, rows: Sequence[Sequence[Any]]) -> None:
        self._run(query, [tuple(row) for row in rows])

    def rows_of(self, thread_id: str) -> tuple[int, int, int]:
        """How many rows of the thread remain in threads, thread_messages and sessions."""
        row = self.fetch(
            "SELECT (SELECT count(*) FROM threads WHERE id = $1), "
            "(SELECT count(*) FROM thread_messages WHERE thread_id = $1), "
            "(SELECT count(*) FROM sessions WHERE thread_id = $1)",
            thread_id,
        )[0]
        return int(row[0]), int(row[1]), int(row[2])


# -- Redis -----------------------------------------------------------------------------------------------------------


class RedisKeys:
    """The cache keys statestore keeps for a thread under one server's prefix: `<prefix>{thr_…}:h` and `:n`."""

    def __init__(self, url: str, prefix: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.prefix = prefix

    def keys_of(self, thread_id: str) -> list[str]:
        wanted = [f"{self.prefix}{{{thread_id}}}:h", f"{self.prefix}{{{thread_id}}}:n"]
        return [key for key in wanted if self.client.exists(key)]

    def close(self) -> None:
        self.client.close()


# -- servers, the clock and the CLI ----------------------------------------------------------------------------------


def start_server(
    database_url: str, upstream_url: str, redis_url: str, prefix: str, env: Mapping[str, str]
) -> StatestoreServer:
    return StatestoreServer(
        database_url=database_url, upstream_url=upstream_url, redis_url=redis_url, redis_prefix=prefix, env=env
    )


class ClockFile:
    """The injectable clock (STATESTORE_CLOCK_OFFSET_FILE): seconds added to every statestore process's wall clock."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0.0
        self.advance(0)

    def advance(self, seconds: float) -> None:
        self.offset += seconds
        # Replaced, not rewritten in place: a server reading it meanwhile must never see it empty or half-written.
        scratch = self.path.with_name(self.path.name + ".new")
        scratch.write_text(repr(self.offset))
        os.replace(scratch, self.path)

    def now(self) -> float:
        """The servers' time, in seconds since the epoch."""
        return time.time() + self.offset


def cli_env(database_url: str, **settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STATESTORE_")}
    env["STATESTORE_DATABASE_URL"] = database_url
    env.update({f"STATESTORE_{name.upper()}": value for name, value in settings.items()})
    return env


def cli(env: Mapping[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """`statestore <args>` as a subprocess."""
    return cli_many(env, [list(args)])[0]


def cli_many(
    env: Mapping[str, str], commands: Sequence[Sequence[str] | tuple[Mapping[str, str], Sequence[str]]]
) -> list[subprocess.CompletedProcess[str]]:
    """Several independent `statestore` commands (each an argument list, or an (env, argument list) pair), run at the
    same time: each process takes about half a second to start."""
    started = []
    for command in commands:
        own_env, args = command if isinstance(command, tuple) else (env, command)
        process = subprocess.Popen(
            [sys.executable, "-m", "statestore.cli", *args],
            env=dict(own_env),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        started.append((list(args), process))
    done = []
    for args, process in started:
        out, err = process.communicate(timeout=60)
        done.append(subprocess.CompletedProcess(args, process.returncode, out, err))
    return done


def cli_ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, f"{result.args} exited {result.returncode}: {result.stderr}"
    assert "Traceback" not in result.stderr
    return result.stdout


def cli_json(result: subprocess.CompletedProcess[str]) -> Any:
    return orjson.loads(cli_ok(result))


def cli_fails(result: subprocess.CompletedProcess[str], message: str) -> None:
    """A command that must fail with one clear line on stderr, and print nothing on stdout."""
    assert result.returncode != 0, f"{result.args} succeeded: {result.stdout}"
    assert "Traceback" not in result.stderr, result.stderr
    assert message in result.stderr, result.stderr
    assert result.stderr.startswith("statestore: "), result.stderr
    assert result.stdout == ""
