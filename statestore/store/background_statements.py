"""The statements every background turn runs beyond a foreground turn's (its admission, the keep before its commit,
its end), and the one every replica's runner polls with (`claimable`), each written once, as SQLAlchemy Core: run
through Core on SQLite, and on PostgreSQL compiled once for asyncpg and run as prepared statements on the hot path's
pools (store/background_store.py runs them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import Integer, false, func, insert, literal_column, not_, null, or_, select, update
from sqlalchemy.sql.elements import ColumnClause

from statestore.store.schema import background_responses as bg
from statestore.store.statement import CoreStatement, PgStatement, core_param

OPEN = ("queued", "in_progress")
# As SQL, not bound values: Core expands a list of values at each execution, which a statement compiled once cannot.
_OPEN_SQL: list[ColumnClause[Any]] = [literal_column(f"'{status}'") for status in OPEN]
_p = core_param


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


def _admit() -> Any:
    """The row, unless its owner already has `bound` open turns: one statement, no transaction around a count."""
    given = (
        *("id", "owner", "tenant_id", "metadata_user_id", "conversation_id", "conversation_lease", "status"),
        *("request", "headers", "body", "claim_token", "claim_expires_ms", "attempt", "expires_ms"),
    )
    values: dict[str, Any] = {name: _p(name, bg.c[name].type) for name in given}
    now = _p("now_ms", bg.c.created_ms.type)
    values |= {"cancel_requested": false(), "created_ms": now, "updated_ms": now}
    open_turns = (
        select(func.count()).select_from(bg).where(bg.c.owner == _p("owner"), bg.c.status.in_(_OPEN_SQL))
    ).scalar_subquery()
    return insert(bg).from_select(list(values), select(*values.values()).where(open_turns < _p("bound", Integer)))


# Durable: the client is told the id once this returns, and polls it.
ADMIT: Final = CoreStatement(Admit, _admit(), durable=True)
ADMIT_PG: Final[PgStatement[Admit]] = ADMIT.on_pg()


@dataclass(slots=True, kw_only=True)
class End:
    id: str
    token: str
    status: str
    body: bytes | None  # None: the body kept
    now_ms: int


_HELD = (bg.c.id == _p("id"), bg.c.claim_token == _p("token"), bg.c.status.in_(_OPEN_SQL))
# Not waiting for its WAL flush: an end lost in a crash leaves the turn open with a claim that runs out, and whoever
# claims it next ends it again from what is stored (its response, its events, its cancel mark).
END: Final = CoreStatement(
    End,
    update(bg)
    .where(*_HELD)
    .values(
        status=_p("status"),
        body=func.coalesce(_p("body", bg.c.body.type), bg.c.body),
        headers=null(),
        claim_token=null(),
        claim_expires_ms=null(),
        updated_ms=_p("now_ms"),
    ),
    durable=False,
)
END_PG: Final[PgStatement[End]] = END.on_pg()


@dataclass(slots=True, kw_only=True)
class KeepForCommit:
    id: str
    token: str
    now_ms: int
    until_ms: int


# Just before a run commits its response: the turn is still this replica's, not asked to be cancelled, and its claim
# is renewed, so that no replica (nor a cancel of a turn whose claim ran out) ends it while the commit is under way.
# Not waiting for its flush, as a lease: a renewal lost in a crash only frees the turn sooner.
KEEP_FOR_COMMIT: Final = CoreStatement(
    KeepForCommit,
    update(bg)
    .where(*_HELD, not_(bg.c.cancel_requested))
    .values(claim_expires_ms=_p("until_ms"), updated_ms=_p("now_ms")),
    durable=False,
)
KEEP_FOR_COMMIT_PG: Final[PgStatement[KeepForCommit]] = KEEP_FOR_COMMIT.on_pg()


@dataclass(slots=True, kw_only=True)
class Claimable:
    now_ms: int
    limit: int


# Every replica runs this once a poll (STATESTORE_BACKGROUND_POLL_SECONDS) for as long as it serves, with or without
# background turns: prepared, it costs a fraction of the Core query's compile-cache lookup and result processing.
CLAIMABLE: Final = CoreStatement(
    Claimable,
    select(bg.c.id)
    .where(
        bg.c.status.in_(_OPEN_SQL),
        or_(bg.c.claim_expires_ms.is_(None), bg.c.claim_expires_ms <= _p("now_ms", bg.c.claim_expires_ms.type)),
    )
    .order_by(bg.c.created_ms)
    .limit(_p("limit", Integer)),
    durable=False,
)
CLAIMABLE_PG: Final[PgStatement[Claimable]] = CLAIMABLE.on_pg()
