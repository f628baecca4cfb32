"""Encryption at rest, the keys, with real processes on PostgreSQL (docs/encryption.md): the server refuses to
start on a master key removed from the ring, a wrong key under the right id, or sealed content with no keys, naming
the key id; a key store of its own (STATESTORE_KEYSTORE_URL) is made by `statestore migrate`, used, and reached by an
erasure, which destroys the scope's data keys; `statestore admin encryption rotate` runs while threaded turns are
served, none fails, and once the old master key is dropped and the server restarted everything continues.

The data keys here are made through `SealedContent.sealer()` directly, as a store does on a scope's first use: these
tests need no store to seal, and hold whatever the stores seal besides."""

from __future__ import annotations

import asyncio
import secrets
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from statestore.content_keys import Scope, row_data
from statestore.encryption.content import ScopeSealer, SealedContent
from statestore.encryption.master_keys import MasterKeyRing
from statestore.sealing import new_key_text, parse_keys
from statestore.store.engine import create_engine
from statestore.store.keystore import KeyStore
from tests.conftest import migrated_scratch_pg_database, scratch_pg_database
from tests.support.admin_api import (
    ADMIN_TOKENS,
    UPSTREAM_KEY,
    AdminApi,
    Api,
    cli,
    cli_env,
    cli_fails,
    cli_json,
    cli_ok,
    created,
    run_async,
)
from tests.support.fake_backend import FakeBackend
from tests.support.server import OWNER_SECRET, REPO, StatestoreServer, free_port

K1, K2 = new_key_text(), new_key_text()
SealedValue = tuple[bytes, bytes, bytes]  # (sealed, associated data, plaintext)


@pytest.fixture
async def content_db(postgres_admin_url: str) -> AsyncIterator[str]:
    async with migrated_scratch_pg_database(postgres_admin_url) as url:
        yield url


@pytest.fixture
async def keystore_db(postgres_admin_url: str) -> AsyncIterator[str]:
    async with scratch_pg_database(postgres_admin_url) as url:
        yield url


@pytest.fixture
def prefix() -> str:
    return f"sstest:enc:{secrets.token_hex(6)}:"


def seal_values(keystore_url: str, ring: str, scopes: list[Scope]) -> list[SealedValue]:
    """A value sealed under each scope's data key, made on first use as a store makes it."""

    async def make() -> list[SealedValue]:
        engine = create_engine(keystore_url, pool_size=2)
        try:
            content = SealedContent(KeyStore(engine), MasterKeyRing(parse_keys(ring)), clock=lambda: 0)
            made = []
            for i, scope in enumerate(scopes):
                data, plain = row_data("thread_messages", scope.owner, f"thr_{i}", 0), f"MARKER {i}".encode()
                made.append(((await content.sealer(scope)).seal(plain, data), data, plain))
            return made
        finally:
            await engine.dispose()

    return run_async(make)


def open_values(keystore_url: str, ring: str, values: list[SealedValue]) -> list[bytes]:
    async def read() -> list[bytes]:
        engine = create_engine(keystore_url, pool_size=1)
        try:
            content = SealedContent(KeyStore(engine), MasterKeyRing(parse_keys(ring)), clock=lambda: 0)
            return await content.open_many([v for v, _, _ in values], [d for _, d, _ in values], row="test")
        finally:
            await engine.dispose()

    return run_async(read)


def key_counts(url: str) -> dict[str, int]:
    async def count() -> dict[str, int]:
        engine = create_engine(url, pool_size=1)
        try:
            return await KeyStore(engine).count_by_master()
        finally:
            await engine.dispose()

    return run_async(count)


def serve_refused(env: dict[str, str]) -> str:
    """`statestore serve` that must exit at once, non-zero: its output."""
    done = subprocess.run(
        [sys.executable, "-m", "statestore.cli", "serve", "--port", str(free_port())],
        env=env,
        cwd=REPO,
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    return done.stderr


def server(database_url: str, backend: FakeBackend, redis_url: str, prefix: str, **env: str) -> StatestoreServer:
    return StatestoreServer(
        database_url=database_url,
        upstream_url=backend.url,
        redis_url=redis_url,
        redis_prefix=prefix,
        env={f"STATESTORE_{k.upper()}": v for k, v in env.items()},
    )


def scopes(count: int, tenant: str | None = None) -> list[Scope]:
    return [Scope(owner=f"own_{secrets.token_hex(4)}", tenant_id=tenant, user_id=f"u{i % 4}") for i in range(count)]


def test_the_server_refuses_to_start_naming_the_missing_or_wrong_master_key(
    content_db: str, fake_backend_process: FakeBackend
) -> None:
    seal_values(content_db, f"k1:{K1}", scopes(3))
    seal_values(content_db, f"k2:{K2},k1:{K1}", scopes(2))
    base = cli_env(content_db, upstream_url=fake_backend_process.url, owner_secret=OWNER_SECRET)

    removed = serve_refused({**base, "STATESTORE_ENCRYPTION_KEYS": f"k2:{K2}"})
    assert "'k1' (wraps 3 data keys)" in removed, removed
    wrong = new_key_text()
    mistaken = serve_refused({**base, "STATESTORE_ENCRYPTION_KEYS": f"k2:{K2},k1:{wrong}"})
    assert "master key 'k1'" in mistaken and "not the key" in mistaken, mistaken
    unset = serve_refused(base)
    assert "5 data keys" in unset and "k1, k2" in unset and "STATESTORE_ENCRYPTION_KEYS is not set" in unset, unset
    for said in (removed, mistaken, unset):
        assert K1 not in said and K2 not in said and wrong not in said

    # The same refusal, as the operator checks it before a restart.
    status = cli({**base, "STATESTORE_ENCRYPTION_KEYS": f"k2:{K2}"}, "admin", "encryption", "status")
    assert status.returncode == 1 and "PROBLEM" in status.stdout and "'k1'" in status.stdout, status
    shown = cli_json(
        cli({**base, "STATESTORE_ENCRYPTION_KEYS": f"k2:{K2},k1:{K1}"}, "admin", "encryption", "status", "--json")
    )
    assert shown["data_keys"] == {"k1": 3, "k2": 2} and shown["master_keys"] == ["k2", "k1"]
    assert shown["problem"] is None and not shown["keystore_separate"]


def test_a_key_store_of_its_own_is_made_by_migrate_used_and_reached_by_erasure(
    content_db: str, keystore_db: str, fake_backend_process: FakeBackend, redis_url: str, prefix: str
) -> None:
    ring = f"k1:{K1}"
    env = cli_env(content_db, keystore_url=keystore_db, encryption_keys=ring, owner_secret=OWNER_SECRET)
    # Unmade, the server refuses to start on it.
    refused = serve_refused({**env, "STATESTORE_UPSTREAM_URL": fake_backend_process.url})
    assert "run `statestore migrate` first" in refused, refused
    assert "key store ready" in cli_ok(cli(env, "migrate"))
    assert key_counts(keystore_db) == {}

    running = server(
        content_db,
        fake_backend_process,
        redis_url,
        prefix,
        encryption_keys=ring,
        keystore_url=keystore_db,
        auth_mode="keys",
        admin_tokens=ADMIN_TOKENS,
        upstream_api_key=UPSTREAM_KEY,
        key_cache_seconds="0",
        # The erasure below waits this (and a commit's time) for other replicas to forget the keys it destroys.
        data_key_cache_seconds="1",
    )
    try:
        with AdminApi(running.url) as admin:
            mine, key = admin.tenant_with_key()
            theirs, _ = admin.tenant_with_key()
            with Api(running.url, key) as api:
                created(api.create("a turn with a key store of its own"))
            erased_values = seal_values(keystore_db, ring, scopes(3, tenant=mine["id"]))
            kept_values = seal_values(keystore_db, ring, scopes(2, tenant=theirs["id"]))
            # The keys are in the key store's database, none in the content database's own table.
            assert key_counts(keystore_db)["k1"] >= 5
            assert key_counts(content_db) == {}
            status = cli_json(cli(env, "admin", "encryption", "status", "--json"))
            assert status["keystore_separate"] and status["data_keys"] == key_counts(keystore_db)
            assert status["keystore"].startswith("postgresql+asyncpg://") and "statestore_test_" in status["keystore"]

            admin.erase({"tenant": mine["name"]})
            [entry] = [e for e in admin.audit(limit=5) if e["action"] == "erase"]
            assert entry["after"]["data_keys"] >= 3
        from statestore.errors import ContentErased

        with pytest.raises(ContentErased):
            open_values(keystore_db, ring, erased_values[:1])
        assert open_values(keystore_db, ring, kept_values) == [p for _, _, p in kept_values]
    finally:
        running.stop()


def _load(url: str, turns: int, failures: list[str], heads: list[tuple[str, str]], stop: threading.Event) -> None:
    """One conversation of threaded turns, one after another, as fast as the server answers."""
    with Api(url, f"sk-test-{secrets.token_hex(8)}") as api:
        try:
            _, head = created(api.create("the first turn"))
        except (AssertionError, httpx.HTTPError) as exc:
            failures.append(f"create: {exc}")
            return
        for i in range(turns):
            if stop.is_set():
                break
            answer = api.continue_(head, f"turn {i}")
            if answer.status_code != 200:
                failures.append(f"turn {i}: {answer.status_code} {answer.text[:200]}")
                return
            head = answer.json()["id"]
        heads.append((api.api_key or "", head))


def test_rotation_under_load_then_the_old_master_key_is_dropped(
    content_db: str, fake_backend_process: FakeBackend, redis_url: str, prefix: str
) -> None:
    fake_backend_process.reset()
    old_ring, both, new_ring = f"k1:{K1}", f"k2:{K2},k1:{K1}", f"k2:{K2}"
    before = seal_values(content_db, old_ring, scopes(40))
    env = cli_env(content_db, encryption_keys=both)

    # Step 1 of the procedure: every replica restarted with the new key in front.
    running = server(content_db, fake_backend_process, redis_url, prefix, encryption_keys=both)
    failures: list[str] = []
    heads: list[tuple[str, str]] = []
    stop = threading.Event()
    try:
        workers = [threading.Thread(target=_load, args=(running.url, 25, failures, heads, stop)) for _ in range(6)]
        for worker in workers:
            worker.start()
        during = seal_values(content_db, both, scopes(5))  # new scopes meanwhile: wrapped under k2 at once
        rotated = cli(env, "admin", "encryption", "rotate", "--batch-size", "7")
        out = cli_ok(rotated)
        assert "re-wrapped" in out and "no data key is wrapped under 'k1' now" in out, out
        for worker in workers:
            worker.join(timeout=120)
        assert not failures, failures
        assert len(heads) == 6
        again = cli_json(cli(env, "admin", "encryption", "rotate", "--json"))
        assert again["rewrapped"] == 0 and set(again["data_keys"]) == {"k2"}
    finally:
        stop.set()
        running.stop()

    # Step 3: the old master key dropped from the ring, the server restarted: everything continues.
    assert set(key_counts(content_db)) == {"k2"}
    restarted = server(content_db, fake_backend_process, redis_url, prefix, encryption_keys=new_ring)
    try:
        for api_key, head in heads:
            with Api(restarted.url, api_key) as api:
                created(api.continue_(head, "after the old master key is gone"))
    finally:
        restarted.stop()
    values = before + during
    assert open_values(content_db, new_ring, values) == [p for _, _, p in values]
    rotations = [e for e in _audit(content_db) if e[0] == "encryption.rotate"]
    assert rotations and rotations[0][1] == "k2"


def _audit(url: str) -> list[Any]:
    async def read() -> list[Any]:
        engine = create_engine(url, pool_size=1)
        try:
            async with engine.connect() as conn:
                rows = await conn.execute(text("SELECT action, target FROM audit_log ORDER BY id"))
                return [tuple(row) for row in rows.all()]
        finally:
            await engine.dispose()

    return run_async(read)


def test_rotation_is_refused_while_encryption_is_off(content_db: str) -> None:
    cli_fails(cli(cli_env(content_db), "admin", "encryption", "rotate"), "encryption at rest is off")
    status = cli_ok(cli(cli_env(content_db), "admin", "encryption", "status"))
    assert "encryption at rest: off" in status and "data keys: none" in status


def test_replicas_making_a_scope_s_key_at_once_on_postgresql_share_one(content_db: str) -> None:
    """The unique scope_hash decides: of concurrent first uses on several engines, one key is stored and used by all."""
    scope = Scope(owner="own_race", tenant_id=None, user_id=None)

    async def race() -> set[bytes]:
        engines = [create_engine(content_db, pool_size=1) for _ in range(6)]
        try:
            replicas = [
                SealedContent(KeyStore(e), MasterKeyRing(parse_keys(f"k1:{K1}")), clock=lambda: 0) for e in engines
            ]
            sealers = await asyncio.gather(*(r.sealer(scope) for r in replicas))
            return {s.key_id for s in sealers if isinstance(s, ScopeSealer)}
        finally:
            for engine in engines:
                await engine.dispose()

    assert len(run_async(race)) == 1
    assert key_counts(content_db) == {"k1": 1}
