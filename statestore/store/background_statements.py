"""The statements every background turn runs beyond a foreground turn's (its admission, the keep before its commit,
its end), and the one every replica's runner polls with (`claimable`), built once: SQLAlchemy Core for SQLite, and
asyncpg prepared statements on the hot path's pools for PostgreSQL (store/background_store.py runs them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from sqlalchemy import bindparam, func, insert, select, update

from statestore.store.schema import background_responses as bg
from statestore.store.statement import PgStatement

OPEN = ("queued", "in_progress")

# The two statements every background turn runs, built once (SQLAlchemy then reuses their compiled form).
ADMITTED_COLUMNS = (
    bg.c.id,
    bg.c.owner,
    bg.c.tenant_id,
    bg.c.metadata_user_id,
    bg.c.conversation_id,
    bg.c.conversation_lease,
    bg.c.status,
    bg.c.request,
    bg.c.headers,
    bg.c.body,
    bg.c.claim_token,
    bg.c.claim_expires_ms,
    bg.c.attempt,
    bg.c.cancel_requested,
    bg.c.created_ms,
    bg.c.updated_ms,
    bg.c.expires_ms,
)
# The row, unless its owner already has `bound` open turns: one statement, no transaction around a count.
CORE_ADMIT = insert(bg).from_select(
    [column.name for column in ADMITTED_COLUMNS],
    select(*[bindparam(column.name, type_=column.type) for column in ADMITTED_COLUMNS]).where(
        select(func.count())
        .select_from(bg)
        .where(bg.c.owner == bindparam("owner"), bg.c.status.in_(OPEN))
        .scalar_subquery()
        < bindparam("bound")
    ),
)
CORE_END = (
    update(bg)
    .where(bg.c.id == bindparam("end_id"), bg.c.claim_token == bindparam("end_token"), bg.c.status.in_(OPEN))
    .values(
        status=bindparam("end_status"),
        headers=None,
        claim_token=None,
        claim_expires_ms=None,
        updated_ms=bindparam("end_now"),
    )
)
CORE_END_WITH_BODY = CORE_END.values(body=bindparam("end_body"))


# The same two statements as asyncpg prepared statements on the hot path's pools (PostgreSQL): a background turn is a
# turn, and these are what it costs beyond a foreground one.
@dataclass(slots=True, kw_only=True)
class Admit:
    id: str
    owner: str
    tenant_id: str | None
    metadata_user_id: str | None
    conversation_id: str | None
    conversation_lease: str | None
    status: str
    request: bytes
    headers: bytes
    body: bytes
    claim_token: str | None
    claim_expires_ms: int | None
    attempt: int
    now_ms: int
    expires_ms: int
    bound: int


# Durable: the client is told the id once this returns, and polls it.
PG_ADMIT: Final = PgStatement(
    Admit,
    """
INSERT INTO background_responses (id, owner, tenant_id, metadata_user_id, conversation_id, conversation_lease, status,
    request, headers, body, claim_token, claim_expires_ms, attempt, cancel_requested, created_ms, updated_ms,
    expires_ms)
SELECT :id::varchar, :owner::varchar, :tenant_id::varchar, :metadata_user_id::varchar, :conversation_id::varchar,
    :conversation_lease::varchar, :status::varchar, :request::bytea, :headers::bytea, :body::bytea,
    :claim_token::varchar, :claim_expires_ms::bigint, :attempt::integer, false, :now_ms::bigint, :now_ms::bigint,
    :expires_ms::bigint
WHERE (SELECT count(*) FROM background_responses
       WHERE owner = :owner::varchar AND status IN ('queued', 'in_progress')) < :bound::integer
""",
    durable=True,
)


@dataclass(slots=True, kw_only=True)
class End:
    id: str
    token: str
    status: str
    body: bytes | None
    now_ms: int


# Not waiting for its WAL flush: an end lost in a crash leaves the turn open with a claim that runs out, and whoever
# claims it next ends it again from what is stored (its response, its events, its cancel mark).
PG_END: Final = PgStatement(
    End,
    """
UPDATE background_responses SET status = :status::varchar, body = coalesce(:body::bytea, body), headers = NULL,
    claim_token = NULL, claim_expires_ms = NULL, updated_ms = :now_ms::bigint
WHERE id = :id::varchar AND claim_token = :token::varchar AND status IN ('queued', 'in_progress')
""",
    durable=False,
)


@dataclass(slots=True, kw_only=True)
class KeepForCommit:
    id: str
    token: str
    now_ms: int
    until_ms: int


# Just before a run commits its response: the turn is still this replica's, not asked to be cancelled, and its claim
# is renewed, so that no replica (nor a cancel of a turn whose claim ran out) ends it while the commit is under way.
# Not waiting for its flush, as a lease: a renewal lost in a crash only frees the turn sooner.
PG_KEEP_FOR_COMMIT: Final = PgStatement(
    KeepForCommit,
    """
UPDATE background_responses SET claim_expires_ms = :until_ms::bigint, updated_ms = :now_ms::bigint
WHERE id = :id::varchar AND claim_token = :token::varchar AND status IN ('queued', 'in_progress')
    AND NOT cancel_requested
""",
    durable=False,
)
CORE_KEEP_FOR_COMMIT = (
    update(bg)
    .where(
        bg.c.id == bindparam("keep_id"),
        bg.c.claim_token == bindparam("keep_token"),
        bg.c.status.in_(OPEN),
        bg.c.cancel_requested.is_(False),
    )
    .values(claim_expires_ms=bindparam("keep_until"), updated_ms=bindparam("keep_now"))
)


@dataclass(slots=True, kw_only=True)
class Claimable:
    now_ms: int
    limit: int


# Every replica runs this once a poll (STATESTORE_BACKGROUND_POLL_SECONDS) for as long as it serves, with or without
# background turns: prepared, it costs a fraction of the Core query's compile-cache lookup and result processing.
PG_CLAIMABLE: Final = PgStatement(
    Claimable,
    """
SELECT id FROM background_responses
WHERE status IN ('queued', 'in_progress') AND (claim_expires_ms IS NULL OR claim_expires_ms <= :now_ms::bigint)
ORDER BY created_ms LIMIT :limit::integer
""",
    durable=False,
)
