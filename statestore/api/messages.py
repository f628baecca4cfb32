"""`/v1/messages` and its siblings: a threaded turn when the request asks for one, otherwise a relay."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from statestore.api.deps import Resources, ResourcesDep
from statestore.api.relay import relay
from statestore.errors import InvalidRequest, MethodNotAllowed
from statestore.threads.turn import read_turn

router = APIRouter()


def _path_and_query(request: Request) -> str:
    query = request.url.query
    return request.url.path + (f"?{query}" if query else "")


async def _json_body(request: Request) -> tuple[bytes, dict[str, Any]]:
    content_type = request.headers.get("content-type", "")
    if content_type.split(";", 1)[0].strip().lower() != "application/json":
        raise InvalidRequest("content-type must be application/json")
    body = await request.body()
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc.msg} at position {exc.pos}") from None
    if not isinstance(parsed, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body, parsed


@router.post("/v1/messages")
async def create_message(request: Request, resources: ResourcesDep) -> Response:
    # Normally served by MessagesFastPath before the router; the route stays for the OpenAPI document and as the
    # path an app without that middleware takes.
    return await handle_message(request, resources)


async def handle_message(request: Request, resources: Resources) -> Response:
    body, parsed = await _json_body(request)
    headers = request.headers.raw
    turn = read_turn(parsed, headers)
    if turn is None:
        credential = await resources.relay_credential(headers)
        return await relay(resources.upstream, "POST", _path_and_query(request), headers, body, credential=credential)
    principal = await resources.authenticator.authenticate(headers)
    return await resources.threads.handle(turn, principal, headers, request.url.query)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request, resources: ResourcesDep) -> Response:
    body, parsed = await _json_body(request)
    if "thread" in parsed:
        raise InvalidRequest("count_tokens does not take a thread field")
    headers = request.headers.raw
    credential = await resources.relay_credential(headers)
    return await relay(resources.upstream, "POST", _path_and_query(request), headers, body, credential=credential)


# Included last: every /v1 path no other route claims goes to the backend unchanged.
fallback_router = APIRouter()
_OWN_PATHS = ("/v1/threads", "/v1/sessions")


@fallback_router.api_route(
    "/v1/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False
)
async def relay_other(request: Request, resources: ResourcesDep) -> Response:
    if request.url.path.startswith(_OWN_PATHS):
        # statestore's own resources: a method they do not take is not the backend's business.
        raise MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}")
    body = await request.body()
    headers = request.headers.raw
    credential = await resources.relay_credential(headers)
    return await relay(
        resources.upstream, request.method, _path_and_query(request), headers, body, credential=credential
    )
