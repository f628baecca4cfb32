"""A write sent with an `Idempotency-Key`, on either door (statestore/core/idempotency.py holds the rules): the write
run once under its key, its response kept as the outcome a retry gets, a retry answered from it. A request without
the header never comes here (its only cost is one header lookup)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from starlette.responses import Response

from statestore.api.responses import BytesReply, StreamedReply, bytes_response, streaming_response
from statestore.auth import Principal
from statestore.core.idempotency import (
    KEY_HEADER,
    MAX_KEY_LENGTH,
    Claim,
    Idempotency,
    KeyedRequest,
    Outcome,
    Recover,
    fingerprint,
    read_key,
    user_of,
)
from statestore.errors import IdempotencyKeyInFlight, StatestoreError

log = logging.getLogger(__name__)

REPLAYED = (b"idempotent-replayed", b"true")
# Headers that belong to one exchange, not to its outcome.
_NOT_KEPT = frozenset({b"content-length", b"request-id", b"date", b"server"})

Follow = Callable[[str], AsyncIterator[bytes]]

# The header in the OpenAPI document of every write that takes it.
OPENAPI_PARAMETER: dict[str, Any] = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": False,
    "schema": {"type": "string", "minLength": 1, "maxLength": MAX_KEY_LENGTH, "pattern": "^[!-~]+$"},
    "description": (
        "Make a retry safe: the same key with the same request returns the first outcome (same ids, same body, a "
        "stream replayed) and stores nothing again; while the first still runs, 409 idempotency_key_in_flight; with "
        "another request, 422 idempotency_key_reused. Owner-scoped, kept for the policy's idempotency_ttl_seconds."
    ),
}


def with_key(openapi_extra: dict[str, Any]) -> dict[str, Any]:
    """A write's `openapi_extra` with the Idempotency-Key header among its parameters."""
    return {**openapi_extra, "parameters": [*openapi_extra.get("parameters", []), OPENAPI_PARAMETER]}


def key_of(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    for name, value in headers:
        if name == KEY_HEADER:
            return value
    return None


async def _nothing_found(_intended: str) -> Outcome | None:
    return None


async def write_once(
    idempotency: Idempotency,
    principal: Principal,
    headers: list[tuple[bytes, bytes]],
    *,
    route: str,
    body: bytes,
    shaping: tuple[bytes | None, ...] = (),
    intended: str,
    run: Callable[[str], Awaitable[Response]],
    recover: Recover = _nothing_found,
    user_id: str | None = None,
) -> Response:
    """`run(intended)`, under the request's Idempotency-Key when it has one (keyed_write), else as it is. `recover`:
    the outcome a write left when it is found done; by default none is (the write runs again, under the same ids)."""
    raw_key = key_of(headers)
    if raw_key is None:
        return await run(intended)
    return await keyed_write(
        idempotency,
        principal,
        raw_key,
        route=route,
        body=body,
        shaping=shaping,
        intended=intended,
        run=lambda claim: run(claim.intended),
        recover=recover,
        user_id=user_id,
    )


def outcome_of(response: Response) -> Outcome:
    """A whole response as the outcome a retry gets (a write found done by `recover`)."""
    return _outcome(response, bytes(response.body), streamed=False)


async def keyed_write(
    idempotency: Idempotency,
    principal: Principal,
    raw_key: bytes,
    *,
    route: str,
    body: bytes,
    shaping: tuple[bytes | None, ...] = (),
    intended: str,
    run: Callable[[Claim], Awaitable[Response]],
    recover: Recover,
    follow: Follow | None = None,
    user_id: str | None = None,
) -> Response:
    """Run `run(claim)` once under the key (the write stores under `claim.intended`), or answer with the outcome kept
    (or found stored by `recover`). `user_id`: the `metadata.user_id` whose erasure erases the key, when the body does
    not say it (an append's is its conversation's)."""
    request = KeyedRequest(
        owner=principal.owner,
        tenant_id=principal.tenant_id,
        user_id=user_id if user_id is not None else user_of(body),
        key=read_key(raw_key),
        fingerprint=fingerprint(route, body, *shaping),
    )
    begun = await idempotency.begin(request, intended=intended, recover=recover)
    if isinstance(begun, Outcome):
        return replayed(begun, follow)
    try:
        response = await run(begun)
    except StatestoreError as exc:
        # In flight, whether the write is stored is not known yet: the key keeps its intended ids for the next retry.
        await _fail(idempotency, begun, stored_nothing=exc.status < 500 and not isinstance(exc, IdempotencyKeyInFlight))
        raise
    except BaseException:
        await _fail(idempotency, begun, stored_nothing=False)
        raise
    if isinstance(response, StreamedReply):

        async def ended(chunks: list[bytes] | None) -> None:
            if chunks is None:
                await _fail(idempotency, begun, stored_nothing=False)
            else:
                await _keep(idempotency, begun, _outcome(response, b"".join(chunks), streamed=True))

        return response.captured(ended)
    if isinstance(response, BytesReply) and 200 <= response.status_code < 300:
        await _keep(idempotency, begun, _outcome(response, bytes(response.body), streamed=False))
    else:
        await _fail(idempotency, begun, stored_nothing=response.status_code < 500)
    return response


def _outcome(response: Response, body: bytes, *, streamed: bool) -> Outcome:
    headers = tuple((name, value) for name, value in response.raw_headers if name not in _NOT_KEPT)
    return Outcome(status=response.status_code, headers=headers, body=body, streamed=streamed)


def replayed(outcome: Outcome, follow: Follow | None) -> Response:
    headers = [*outcome.headers, REPLAYED]
    if outcome.follow is not None and follow is not None:
        return streaming_response(outcome.status, follow(outcome.follow), headers, on_close=_nothing)
    if outcome.streamed:
        return streaming_response(outcome.status, _once(outcome.body), headers, on_close=_nothing)
    return bytes_response(outcome.status, outcome.body, headers)


async def _once(body: bytes) -> AsyncIterator[bytes]:
    yield body


async def _nothing() -> None:
    """A replay holds nothing to give back."""


async def _keep(idempotency: Idempotency, claim: Claim, outcome: Outcome) -> None:
    """Keep the outcome; if that fails (a database gone), the claim runs out and a retry finds the write stored by
    its intended ids, so the client still gets its answer now."""
    with anyio.CancelScope(shield=True):
        try:
            await idempotency.succeed(claim, outcome)
        except Exception as exc:
            log.warning("could not keep an idempotent outcome", extra={"error": type(exc).__name__})


async def _fail(idempotency: Idempotency, claim: Claim, *, stored_nothing: bool) -> None:
    with anyio.CancelScope(shield=True):
        try:
            await idempotency.fail(claim, stored_nothing=stored_nothing)
        except Exception as exc:
            log.warning("could not free an idempotency key", extra={"error": type(exc).__name__})
