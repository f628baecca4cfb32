"""Idempotency keys at rest (docs/responses.md, "Retries that never store twice"), on both databases: a key is
claimed by one request at a time, a claim that ran out is taken over with its intended ids, an outcome is kept,
sealed with encryption on, purged when its time is up and erased with its tenant's or user's data."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from sqlalchemy import text

from statestore.config import Settings
from statestore.content_keys import MAGIC
from statestore.core.idempotency import Idempotency, KeyedRequest, Outcome
from statestore.errors import IdempotencyKeyInFlight, IdempotencyKeyReused
from statestore.resources import Resources, build_resources
from statestore.sealing import new_key_text
from tests.conftest import migrated_scratch_pg_database

OWNER_SECRET = "idempotency-owner-secret-0123456789"
NOW = 1_900_000_000_000


@pytest.fixture(params=["postgres", "sqlite", "sqlite-encrypted"])
async def resources(
    request: pytest.FixtureRequest, postgres_admin_url: str, migrated_sqlite_url: str
) -> AsyncIterator[Resources]:
    # An erasure waits out what other replicas remember of the keys it destroyed (the key cache's lifetime, and a
    # commit's time: the database timeout, which bounds nothing on SQLite). There are none here: this process is the
    # only one, and it forgets them at once.
    encrypted = {"encryption_keys": f"k1:{new_key_text()}", "data_key_cache_seconds": 0, "database_timeout_seconds": 1}
    extra = encrypted if request.param.endswith("encrypted") else {}
    if request.param == "postgres":
        async with migrated_scratch_pg_database(postgres_admin_url) as url:
            settings = Settings(database_url=url, owner_secret=OWNER_SECRET)
            async with build_resources(settings, serving=False) as built:
                yield built
        return
    settings = Settings(database_url=migrated_sqlite_url, owner_secret=OWNER_SECRET, **extra)  # type: ignore[arg-type]
    async with build_resources(settings, serving=False) as built:
        yield built


def keyed(key: str, *, tenant: str | None = "t1", user: str | None = None, body: str = "a") -> KeyedRequest:
    return KeyedRequest(owner="p:owner", tenant_id=tenant, user_id=user, key=key, fingerprint=body * 64)


async def nothing_stored(_intended: str) -> Outcome | None:
    return None


async def _ttl(_tenant: str | None) -> int:
    return 3600


async def test_one_claim_at_a_time_then_the_outcome(resources: Resources) -> None:
    now = [NOW]
    keys = Idempotency(resources.idempotency.store, clock=lambda: now[0], claim_seconds=30, ttl_for=_ttl)
    claim = await keys.begin(keyed("k"), intended="resp_1", recover=nothing_stored)
    assert not isinstance(claim, Outcome) and claim.intended == "resp_1"
    with pytest.raises(IdempotencyKeyInFlight):
        await keys.begin(keyed("k"), intended="resp_2", recover=nothing_stored)
    with pytest.raises(IdempotencyKeyReused) as reused:
        await keys.begin(keyed("k", body="b"), intended="resp_2", recover=nothing_stored)
    assert "'k'" in reused.value.message
    outcome = Outcome(status=200, headers=((b"content-type", b"application/json"),), body=b'{"id":"resp_1"}')
    await keys.succeed(claim, outcome)
    assert await keys.begin(keyed("k"), intended="resp_3", recover=nothing_stored) == outcome
    async with resources.engine.connect() as conn:
        stored = (await conn.execute(text("SELECT outcome FROM idempotency_keys WHERE key = 'k'"))).scalar_one()
    # Sealed with encryption on: the reply is not in the row in clear.
    assert (stored[: len(MAGIC)] == MAGIC) == resources.content.enabled
    assert (b"resp_1" in stored) != resources.content.enabled


async def test_a_claim_that_ran_out_is_taken_over_with_its_intended_ids(resources: Resources) -> None:
    now = [NOW]
    keys = Idempotency(resources.idempotency.store, clock=lambda: now[0], claim_seconds=30, ttl_for=_ttl)
    first = await keys.begin(keyed("k"), intended="resp_1", recover=nothing_stored)
    assert not isinstance(first, Outcome)
    first.keeper.stop()  # the replica stops
    now[0] += 31_000
    second = await keys.begin(keyed("k"), intended="resp_2", recover=nothing_stored)
    assert not isinstance(second, Outcome) and second.intended == "resp_1"
    await keys.fail(second, stored_nothing=False)

    async def found(intended: str) -> Outcome | None:
        return Outcome(status=200, headers=(), body=intended.encode())

    # Freed with its intended ids kept: a retry finds the write stored and is answered (and keeps the answer).
    assert (await keys.begin(keyed("k"), intended="resp_3", recover=found)).body == b"resp_1"  # type: ignore[union-attr]
    assert (await keys.begin(keyed("k"), intended="resp_4", recover=nothing_stored)).body == b"resp_1"  # type: ignore[union-attr]
    # A refused write (nothing stored) forgets its key: another request may use it.
    refused = await keys.begin(keyed("r"), intended="resp_5", recover=nothing_stored)
    assert not isinstance(refused, Outcome)
    await keys.fail(refused, stored_nothing=True)
    assert not isinstance(await keys.begin(keyed("r", body="c"), intended="resp_6", recover=nothing_stored), Outcome)


async def test_a_claim_names_the_ids_its_write_learnt_once_it_began(resources: Resources) -> None:
    """A session turn knows its thread only once it has taken the head (api/threaded_keyed.py): its claim names the
    reply's id then, before the commit, and a retry looks for that one; a claim taken over can no longer name any."""
    now = [NOW]
    keys = Idempotency(resources.idempotency.store, clock=lambda: now[0], claim_seconds=30, ttl_for=_ttl)
    first = await keys.begin(keyed("k"), intended="msg_proposed", recover=nothing_stored)
    assert not isinstance(first, Outcome)
    await keys.intend(first, "msg_in_the_session", user_id="user-7")
    assert first.intended == "msg_in_the_session" and first.request.user_id == "user-7"
    async with resources.engine.connect() as conn:
        named = (await conn.execute(text("SELECT metadata_user_id FROM idempotency_keys WHERE key = 'k'"))).scalar()
    assert named == "user-7"  # erased with that user's data
    first.keeper.stop()  # the replica stops after the commit, before it kept the outcome
    now[0] += 31_000
    looked_for: list[str] = []

    async def found(intended: str) -> Outcome | None:
        looked_for.append(intended)
        return Outcome(status=200, headers=(), body=intended.encode())

    assert (await keys.begin(keyed("k"), intended="msg_other", recover=found)).body == b"msg_in_the_session"  # type: ignore[union-attr]
    assert looked_for == ["msg_in_the_session"]
    # A claim that ran out and was taken over by another request is no longer the first's to name.
    stale = await keys.begin(keyed("s"), intended="msg_a", recover=nothing_stored)
    assert not isinstance(stale, Outcome)
    stale.keeper.stop()
    now[0] += 31_000
    taken = await keys.begin(keyed("s"), intended="msg_b", recover=nothing_stored)
    assert not isinstance(taken, Outcome)
    with pytest.raises(IdempotencyKeyInFlight):
        await keys.intend(stale, "msg_c", user_id=None)
    await keys.fail(taken, stored_nothing=True)


async def test_keys_are_purged_when_their_time_is_up_and_erased_with_their_owner(resources: Resources) -> None:
    now = [resources.clock()]
    keys = Idempotency(resources.idempotency.store, clock=lambda: now[0], claim_seconds=30, ttl_for=_ttl)
    outcome = Outcome(status=200, headers=(), body=b"{}")
    for key, tenant, user in (("old", "t1", None), ("t1", "t1", None), ("t2", "t2", None), ("u", "t2", "user-9")):
        claim = await keys.begin(keyed(key, tenant=tenant, user=user), intended="x", recover=nothing_stored)
        assert not isinstance(claim, Outcome)
        await keys.succeed(claim, outcome)
        if key == "old":
            now[0] += 3_600_000  # the first one's time runs out; the rest are kept
    async with resources.engine.begin() as conn:
        await conn.execute(text("UPDATE idempotency_keys SET expires_ms = :t WHERE key = 'old'"), {"t": 1})

    async def remaining() -> list[str]:
        async with resources.engine.connect() as conn:
            return sorted(row[0] for row in await conn.execute(text("SELECT key FROM idempotency_keys")))

    await resources.retention.purge()
    assert await remaining() == ["t1", "t2", "u"]
    await resources.retention.erase(actor="test", user_id="user-9")
    assert await remaining() == ["t1", "t2"]
    await resources.retention.erase(actor="test", tenant_id="t1")
    assert await remaining() == ["t2"]
