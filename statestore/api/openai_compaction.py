"""`POST /v1/responses/compact` (docs/responses.md, "Compaction"): a context summarised into one compaction item, stored
nowhere. Not a hot route: a compaction is rare beside the turns it saves."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from statestore.api.deps import ResourcesDep
from statestore.api.openai_responses import json_response, turns_of
from statestore.errors import ServiceUnavailable
from statestore.responses import request_schemas, schemas
from statestore.responses.compact_request import compacted
from statestore.responses.compaction import unavailable
from statestore.responses.request import read_compact
from statestore.store.engine import DATABASE_ERRORS

router = APIRouter(tags=["responses"], responses=schemas.ERRORS)


@router.post(
    "/v1/responses/compact",
    openapi_extra=request_schemas.request_body(request_schemas.ResponseCompactRequest),
    responses=schemas.ok(schemas.CompactedResponse, "every user message of the context, then one compaction item"),
)
async def compact_response(request: Request, resources: ResourcesDep) -> Response:
    """Compact a context: the chain of `previous_response_id`, then `input`."""
    headers = request.headers.raw
    principal = await resources.authenticator.authenticate(headers)
    turns = turns_of(resources)
    if turns.seal is None:
        raise unavailable(None)
    turn = read_compact(await request.body())
    try:
        prepared = await turns.prepare(turn, principal, None, headers=headers)
    except DATABASE_ERRORS as exc:
        raise ServiceUnavailable("the response store is unavailable; try again shortly") from exc
    try:
        return json_response(await compacted(prepared, resources.chat_upstream, headers, principal, turns.seal))
    finally:
        await turns.give_back(prepared)
