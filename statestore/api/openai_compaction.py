"""`POST /v1/responses/compact` (docs/responses.md, "Compaction"): a context summarised into one compaction item, stored
nowhere. Not a hot route: a compaction is rare beside the turns it saves."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from statestore.api.deps import ResourcesDep
from statestore.api.idempotent import key_of, with_key, write_once
from statestore.api.openai_responses import json_response, turns_of, user_of_turn
from statestore.errors import ServiceUnavailable
from statestore.responses import request_schemas, schemas
from statestore.responses.compact_request import compacted
from statestore.responses.compaction import unavailable
from statestore.responses.ids import new_id
from statestore.responses.request import read_compact
from statestore.store.engine import DATABASE_ERRORS

router = APIRouter(tags=["responses"], responses=schemas.ERRORS)


@router.post(
    "/v1/responses/compact",
    openapi_extra=with_key(request_schemas.request_body(request_schemas.ResponseCompactRequest)),
    responses=schemas.ok(schemas.CompactedResponse, "every user message of the context, then one compaction item"),
)
async def compact_response(request: Request, resources: ResourcesDep) -> Response:
    """Compact a context: the chain of `previous_response_id`, then `input`."""
    headers = request.headers.raw
    principal = await resources.authenticator.authenticate(headers)
    turns = turns_of(resources)
    seal = turns.seal
    if seal is None:
        raise unavailable(None)
    raw = await request.body()
    turn = read_compact(raw)

    async def run(compaction_id: str) -> Response:
        try:
            prepared = await turns.prepare(turn, principal, None, headers=headers, response_id=compaction_id)
        except DATABASE_ERRORS as exc:
            raise ServiceUnavailable("the response store is unavailable; try again shortly") from exc
        try:
            return json_response(await compacted(prepared, resources.chat_upstream, headers, principal, seal))
        finally:
            await turns.give_back(prepared)

    # With an Idempotency-Key, the compaction is kept under it (it is stored nowhere else): a retry gets the same
    # object, ids and summary, and the backend is not asked again. One whose outcome was lost is compacted anew.
    return await write_once(
        resources.idempotency,
        principal,
        headers,
        route="POST /v1/responses/compact",
        body=raw,
        intended=new_id("resp_"),
        run=run,
        user_id=await user_of_turn(resources, turns, principal.owner, turn) if key_of(headers) is not None else None,
    )
