"""`/v1/messages` and its siblings: a threaded turn when the request asks for one, otherwise a relay."""

from __future__ import annotations

import logging
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from statestore.api import schemas
from statestore.api.deps import ResourcesDep
from statestore.api.hot_routes import hot_route
from statestore.api.idempotent import with_key
from statestore.api.relay import relay
from statestore.api.threaded import serve_threaded_turn
from statestore.api.threaded_count import counted_response
from statestore.api.threaded_keyed import keyed_turn
from statestore.errors import AuthenticationFailed, InvalidRequest
from statestore.resources import Resources
from statestore.store.engine import DATABASE_ERRORS
from statestore.threads.count import counted_request
from statestore.threads.diagnostics import minted_previous_id, rewrite_previous_id
from statestore.threads.turn import read_turn

log = logging.getLogger(__name__)
router = APIRouter()


def _path_and_query(request: Request) -> str:
    query = request.url.query
    return request.url.path + (f"?{query}" if query else "")


def _header(headers: list[tuple[bytes, bytes]], wanted: bytes) -> bytes:
    for name, value in headers:
        if name == wanted:
            return value
    return b""


def parse_json_body(headers: list[tuple[bytes, bytes]], body: bytes) -> dict[str, Any]:
    content_type = _header(headers, b"content-type")
    if content_type.split(b";", 1)[0].strip().lower() != b"application/json":
        raise InvalidRequest("content-type must be application/json")
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc.msg} at position {exc.pos}") from None
    if not isinstance(parsed, dict):
        raise InvalidRequest("request body must be a JSON object")
    return parsed


@hot_route(router, "/v1/messages", openapi_extra=with_key({}))
async def create_message(resources: Resources, headers: list[tuple[bytes, bytes]], query: str, body: bytes) -> Response:
    """A relay, or with `thread` or a session header a threaded turn (docs/protocol.md §2, §6). An `Idempotency-Key`
    makes a threaded turn's retry safe (§11); a relayed request stores nothing, and its key goes to the backend as
    it came."""
    parsed = parse_json_body(headers, body)
    turn = read_turn(parsed, headers)
    if turn is None:
        body = await _relay_body(body, parsed, headers, resources)
        credential = await resources.relay_credential(headers)
        path = "/v1/messages" + (f"?{query}" if query else "")
        return await relay(resources.upstream, "POST", path, headers, body, credential=credential)
    principal = await resources.authenticator.authenticate(headers)
    if turn.idempotency_key is not None:
        return await keyed_turn(
            resources, turn, principal, headers=headers, query=query, body=body, raw_key=turn.idempotency_key
        )
    return await serve_threaded_turn(
        resources.threads, resources.upstream, turn=turn, principal=principal, headers=headers, query=query
    )


async def _relay_body(
    body: bytes, parsed: dict[str, Any], headers: list[tuple[bytes, bytes]], resources: Resources
) -> bytes:
    """The body a stateless request is relayed with: as it came, unless it says `"thread": null` (no thread: the
    field goes, as the request would be without it) or names a reply statestore minted in its diagnostics."""
    changed = False
    if "thread" in parsed:  # only a null one reaches here: read_turn takes any other value as a thread
        del parsed["thread"]
        changed = True
    if minted_previous_id(parsed) is not None:
        try:
            owner = (await resources.authenticator.authenticate(headers)).owner
        except AuthenticationFailed:
            owner = None  # no credential of ours: the id is passed through and the backend judges the request
        if owner is not None:
            try:
                changed |= await rewrite_previous_id(
                    parsed, owner=owner, store=resources.threads.repository, now_ms=resources.clock()
                )
            except DATABASE_ERRORS as exc:
                # A stateless request does not need the store: relay it with the id it came with.
                log.warning("could not look up a diagnostics id", extra={"error": type(exc).__name__})
    return orjson.dumps(parsed) if changed else body


@router.post(
    "/v1/messages/count_tokens",
    responses={
        200: {
            "description": "the backend's answer, as it came; over a thread (a `thread` field or a session header), "
            "the count of the request the turn would send, with a `statestore-token-count: backend|estimate` header "
            "(docs/protocol.md §11)",
            "model": schemas.MessageTokensCount,
        }
    },
)
async def count_tokens(request: Request, resources: ResourcesDep) -> Response:
    """Count a request's input tokens: a relay, or over a thread, what the turn would send after the context policy."""
    headers = request.headers.raw
    body = await request.body()
    parsed = parse_json_body(headers, body)
    turn = read_turn(parsed, headers)
    if turn is not None:
        principal = await resources.authenticator.authenticate(headers)
        counted = await counted_request(resources.threads, turn, principal, headers)
        return await counted_response(resources.threads.counter, counted, principal, headers, request.url.query)
    if "thread" in parsed:  # "thread": null means no thread (docs/protocol.md §2)
        del parsed["thread"]
        body = orjson.dumps(parsed)
    credential = await resources.relay_credential(headers)
    return await relay(resources.upstream, "POST", _path_and_query(request), headers, body, credential=credential)


# Included last: every /v1 path no other route claims goes to the backend unchanged (docs/protocol.md §1: /v1 is the
# Messages API's namespace; statestore's own routes live under /statestore and /admin).
fallback_router = APIRouter()


@fallback_router.api_route(
    "/v1/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False
)
async def relay_other(request: Request, resources: ResourcesDep) -> Response:
    body = await request.body()
    headers = request.headers.raw
    credential = await resources.relay_credential(headers)
    return await relay(
        resources.upstream, request.method, _path_and_query(request), headers, body, credential=credential
    )
