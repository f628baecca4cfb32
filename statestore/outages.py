"""The one error path of an outage (docs/protocol.md §4): what a database or Redis that cannot be reached raises,
and the refusal every route answers for it, whichever door it came through and wherever it was raised (in
authentication too, before any route's own handling)."""

from __future__ import annotations

from statestore.errors import InvalidRequest, ServiceUnavailable, StatestoreError
from statestore.store.engine import DATABASE_ERRORS, UNSTORABLE_VALUE_ERRORS
from statestore.store.resp_reader import RedisConnectionError, RedisTimeout, RespError

# A Redis that statestore needs for a request and cannot reach (most of its uses fall back on the database; what is
# left reaches here).
REDIS_ERRORS: tuple[type[BaseException], ...] = (RedisConnectionError, RedisTimeout, RespError)
OUTAGE_ERRORS: tuple[type[BaseException], ...] = (*DATABASE_ERRORS, *REDIS_ERRORS)


def refusal_for(exc: BaseException) -> StatestoreError | None:
    """The answer to an exception no route handled: a 400 for a value the database cannot hold (the request's
    fault), a 503 with `retry-after` for an outage, None for anything else (a 500)."""
    if isinstance(exc, StatestoreError):
        return exc
    if isinstance(exc, UNSTORABLE_VALUE_ERRORS):
        return InvalidRequest("the request holds a value statestore cannot store or look up")
    if isinstance(exc, OUTAGE_ERRORS):
        return ServiceUnavailable("the database is unavailable; try again shortly")
    return None
