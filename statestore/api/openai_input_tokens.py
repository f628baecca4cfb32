"""`POST /v1/responses/input_tokens` (docs/responses.md, "Counting tokens over stored context"): the input tokens of the
turn a request would make, over its stored context (a chain or a conversation) after the owner's context policy,
without running the model: the backend's own tokenizer where it has one, else statestore's estimator; the
`statestore-token-count` header says which."""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from statestore.api.deps import ResourcesDep
from statestore.api.openai_responses import JSON, turns_of
from statestore.api.responses import bytes_response
from statestore.core.token_count import CountSource, count_header
from statestore.errors import ServiceUnavailable
from statestore.responses import request_schemas, schemas
from statestore.responses.backend import backend_headers
from statestore.responses.request import read_count
from statestore.store.engine import DATABASE_ERRORS

router = APIRouter(tags=["responses"], responses=schemas.ERRORS)


@router.post(
    "/v1/responses/input_tokens",
    openapi_extra=request_schemas.request_body(request_schemas.ResponseInputTokensRequest),
    responses=schemas.ok(
        schemas.InputTokens,
        "the input tokens of the turn; `statestore-token-count: backend|estimate` says who counted them",
    ),
)
async def count_input_tokens(request: Request, resources: ResourcesDep) -> Response:
    """Count a turn's input tokens over its stored context, without running the model."""
    headers = request.headers.raw
    principal = await resources.authenticator.authenticate(headers)
    turns = turns_of(resources)
    turn = read_count(await request.body())
    try:
        prepared = await turns.prepare_count(turn, principal, request.headers.raw)
        await prepared.plan_context(None)  # a `summarize` policy's summary is not asked for: counted as truncated
    except DATABASE_ERRORS as exc:
        raise ServiceUnavailable("the response store is unavailable; try again shortly") from exc
    sent = prepared.backend_body()
    tokens = None
    if turns.tokenizer is not None:
        tokens = await turns.tokenizer.count(orjson.loads(sent), backend_headers(headers, principal))
    source: CountSource = "backend"
    if tokens is None:
        tokens, source = prepared.estimated_tokens(), "estimate"
    body = orjson.dumps({"object": "response.input_tokens", "input_tokens": tokens})
    return bytes_response(200, body, [*JSON, count_header(source)])
