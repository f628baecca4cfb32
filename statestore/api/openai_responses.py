"""`/v1/responses`: a turn (JSON or SSE), retrieve, delete, input_items."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from statestore.api.deps import ResourcesDep
from statestore.api.hot_routes import hot_route
from statestore.api.idempotent import key_of, keyed_write, outcome_of, with_key, write_once
from statestore.api.responses import bytes_response, streaming_response
from statestore.auth import Principal
from statestore.core.idempotency import Outcome
from statestore.errors import ServiceUnavailable
from statestore.resources import Resources
from statestore.responses import request_schemas, schemas
from statestore.responses.backend import summarizer
from statestore.responses.background import BackgroundTurns
from statestore.responses.compaction import unavailable as compaction_unavailable
from statestore.responses.compaction_step import compact
from statestore.responses.context import cache_key
from statestore.responses.errors import BackendError, BadRequest, previous_response_not_found, response_not_found
from statestore.responses.ids import looks_like, new_id
from statestore.responses.kept import KeptResponse
from statestore.responses.prepared import PreparedResponse
from statestore.responses.refusal_retry import send_turn
from statestore.responses.replay import replayed_frames
from statestore.responses.reply import output_of
from statestore.responses.request import TurnRequest, read_turn
from statestore.responses.response_object import completed
from statestore.responses.stream import SequencedEvents
from statestore.responses.turn_events import turn_events, with_compaction
from statestore.responses.turns import ResponseTurns
from statestore.store.engine import DATABASE_ERRORS, UNSTORABLE_VALUE_ERRORS
from statestore.upstream.client import UpstreamResponse

router = APIRouter(tags=["responses"], responses=schemas.ERRORS)
JSON = [(b"content-type", b"application/json")]
SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


def json_response(value: Any, status: int = 200) -> Response:
    return bytes_response(status, orjson.dumps(value), JSON)


def turns_of(resources: Resources) -> ResponseTurns:
    turns = resources.responses
    if turns is None:
        raise BadRequest("No Chat Completions backend is configured (STATESTORE_CHAT_UPSTREAM_URL).", code="no_backend")
    return turns


def header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The first value of a header (a dict built in C, not a loop over every header)."""
    return dict(reversed(headers)).get(name)


@hot_route(
    router,
    "/v1/responses",
    openapi_extra=with_key(request_schemas.request_body(request_schemas.ResponseCreateRequest)),
    responses=schemas.ok(
        schemas.Response,
        "the Response (application/json), or with `stream: true` its events (text/event-stream)",
        content={"text/event-stream": {"schema": {"$ref": "#/components/schemas/ResponseStreamEvent"}}},
    ),
)
async def create_response(
    resources: Resources, headers: list[tuple[bytes, bytes]], _query: str, body: bytes
) -> Response:
    """A `POST /v1/responses`, from its headers and body: the Response (JSON or SSE), or a StatestoreError. The same
    path also takes a WebSocket (WebSocket mode: `response.create` and `response.steer` events, docs/responses.md)."""
    try:
        return await _turn(resources, headers, body)
    except UNSTORABLE_VALUE_ERRORS as exc:
        # A value the database cannot hold (a NUL in text, say) is the request's fault, as on a threaded turn.
        raise BadRequest("The request holds a value that cannot be stored.", code="invalid_value") from exc
    except DATABASE_ERRORS as exc:
        raise ServiceUnavailable("the response store is unavailable; try again shortly") from exc


async def _turn(resources: Resources, headers: list[tuple[bytes, bytes]], body: bytes) -> Response:
    principal = await resources.authenticator.authenticate(headers)
    turns = turns_of(resources)
    turn = read_turn(body)
    raw_key = key_of(headers)
    if raw_key is not None:
        return await _keyed(resources, turns, principal, turn, headers=headers, body=body, raw_key=raw_key)
    return await _run(resources, turns, principal, turn, headers=headers, body=body, response_id=None)


async def _keyed(
    resources: Resources,
    turns: ResponseTurns,
    principal: Principal,
    turn: TurnRequest,
    *,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    raw_key: bytes,
) -> Response:
    """A turn sent with an Idempotency-Key (docs/responses.md, "Retries that never store twice"): stored once under
    the response id its key names, whatever the retries."""
    owner = principal.owner

    async def recover(response_id: str) -> Outcome | None:
        if turn.background:
            found = await background_of(resources).state(owner, response_id)
            if found is None:
                return None
            if turn.stream:
                return Outcome(status=200, headers=tuple(SSE), body=b"", streamed=True, follow=response_id)
            return Outcome(status=200, headers=tuple(JSON), body=found[1])
        row = await turns.responses.get(owner, response_id, now_ms=resources.clock())
        if row is None:
            return None
        stored = completed(row.body)
        if turn.stream:
            return Outcome(
                status=200, headers=tuple(SSE), body=b"".join(replayed_frames(stored, after=-1)), streamed=True
            )
        return Outcome(status=200, headers=tuple(JSON), body=stored)

    def follow(response_id: str) -> AsyncIterator[bytes]:
        return background_of(resources).follow(owner, response_id, after=-1)

    return await keyed_write(
        resources.idempotency,
        principal,
        raw_key,
        user_id=await user_of_turn(resources, turns, owner, turn),
        route="POST /v1/responses",
        body=body,
        shaping=(header(headers, b"statestore-ttl"),),
        intended=new_id("resp_"),
        run=lambda claim: _run(
            resources, turns, principal, turn, headers=headers, body=body, response_id=claim.intended
        ),
        recover=recover,
        follow=follow,
    )


async def user_of_turn(resources: Resources, turns: ResponseTurns, owner: str, turn: TurnRequest) -> str | None:
    """Whose erasure erases what a keyed turn's key keeps (its input and reply): the turn's own `metadata.user_id`,
    else its conversation's, else its previous response's, whose data it adds to."""
    user = turn.metadata.get("user_id")
    if user is not None:
        return user
    now = resources.clock()
    if turn.conversation_id is not None and looks_like("conv_", turn.conversation_id):
        return await turns.conversations.user_id(owner, turn.conversation_id, now_ms=now)
    if turn.previous_response_id is not None and looks_like("resp_", turn.previous_response_id):
        return await turns.responses.user_id(owner, turn.previous_response_id, now_ms=now)
    return None


async def _run(
    resources: Resources,
    turns: ResponseTurns,
    principal: Principal,
    turn: TurnRequest,
    *,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    response_id: str | None,
) -> Response:
    """The turn, under `response_id` when a key's claim named one."""
    if turn.background:
        if turn.compaction and turns.seal is None:
            raise compaction_unavailable("context_management")
        return await _queue(background_of(resources), turn, principal, headers=headers, body=body, intended=response_id)
    prepared, upstream = await begin_turn(resources, headers, principal, turn, response_id=response_id)
    if turn.stream:
        # The lease is the stream's to give back, however it ends.
        events = turn_events(turns, prepared, upstream, SequencedEvents())
        return streaming_response(
            200, events, [*SSE, *_context_header(prepared)], on_close=lambda: end_turn(turns, prepared, upstream)
        )
    try:
        try:
            raw = await upstream.read()
        finally:
            await upstream.aclose()
        try:
            output, status, incomplete, usage = output_of(orjson.loads(raw) if raw else None)
        except orjson.JSONDecodeError:
            raise BackendError("the model backend's reply is not JSON") from None
        response = turns.response(
            prepared, status=status, output=with_compaction(prepared, output), usage=usage, incomplete=incomplete
        )
        encoded = orjson.dumps(response)
        if not await turns.commit(prepared, response, encoded):
            if prepared.parent is not None:  # deleted while the turn ran
                raise previous_response_not_found(prepared.parent.id)
            raise BadRequest("The conversation's lease was lost; nothing was stored.", code="conversation_locked")
        return bytes_response(200, encoded, [*JSON, *_context_header(prepared)])
    finally:
        await turns.give_back(prepared)  # a no-op once the turn is committed


async def begin_turn(
    resources: Resources,
    headers: list[tuple[bytes, bytes]],
    principal: Principal,
    turn: TurnRequest,
    *,
    kept: KeptResponse | None = None,
    held: KeptResponse | None = None,
    response_id: str | None = None,
) -> tuple[PreparedResponse, UpstreamResponse]:
    """A foreground turn up to the backend's reply: prepared (owner, policy, context, lease), compacted or planned,
    and sent. What prepare took is given back if this fails; after it, the caller's (`end_turn`, or a commit).
    Shared by `POST /v1/responses` and WebSocket mode (api/responses_socket.py); `kept`: the connection's response
    kept in memory (store: false), which `previous_response_id` may name; `held`: the stored chain head it made last,
    with its context (ResponseTurns.prepare); `response_id`: the id an Idempotency-Key's claim named."""
    turns = turns_of(resources)
    if turn.compaction and turns.seal is None:
        raise compaction_unavailable("context_management")
    prepared = await turns.prepare(
        turn,
        principal,
        header(headers, b"statestore-ttl"),
        headers=headers,
        kept=kept,
        held=held,
        response_id=response_id,
    )
    try:
        summarize = summarizer(resources.chat_upstream, headers, principal)
        if not await compact(prepared, summarize, turns.seal):
            await prepared.plan_context(summarize)
        upstream = await send_turn(
            resources.chat_upstream, headers, principal, prepared, summarize=summarize, windows=turns.windows
        )
    except BaseException:
        await turns.give_back(prepared)
        raise
    return prepared, upstream


async def end_turn(turns: ResponseTurns, prepared: PreparedResponse, upstream: UpstreamResponse) -> None:
    """A streamed turn is over (committed, failed, or its client gone): the backend's reply closed, the lease given
    back (a no-op after a commit)."""
    await upstream.aclose()
    await turns.give_back(prepared)


async def _queue(
    background: BackgroundTurns,
    turn: TurnRequest,
    principal: Principal,
    *,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    intended: str | None,
) -> Response:
    """A background turn: the Response as queued (JSON), or its events from `response.created` on, live."""
    response_id, queued, frames = await background.admit(turn, principal, headers, body, response_id=intended)
    if not turn.stream:
        return bytes_response(200, queued, JSON)

    async def events() -> AsyncIterator[bytes]:
        for frame in frames:
            yield frame
        async for frame in background.follow(principal.owner, response_id, after=len(frames) - 1):
            yield frame

    return streaming_response(200, events(), SSE, on_close=_nothing)


async def _nothing() -> None:
    """A background turn runs on whatever its client does: a client that leaves only stops following it."""


def background_of(resources: Resources) -> BackgroundTurns:
    turns_of(resources)
    assert resources.background is not None  # built whenever the Responses door is
    return resources.background


def _context_header(prepared: PreparedResponse) -> list[tuple[bytes, bytes]]:
    """As for threads (docs/protocol.md §9): a turn whose context moved says how, and a summary that failed says so."""
    moved = prepared.moved
    if moved is None:
        return []
    said = [(b"statestore-context", moved.action.encode())]
    return [*said, (b"statestore-context-fallback", b"summary_failed")] if moved.summary_failed else said


async def _owner(request: Request, resources: Resources) -> str:
    return (await resources.authenticator.authenticate(request.headers.raw)).owner


@router.get(
    "/v1/responses/{response_id}",
    responses=schemas.ok(
        schemas.Response,
        "the Response as it stands (a background one: queued, in_progress, or how it ended); with `stream=true`, "
        "a background response's events after `starting_after`, live until its final event",
        content={"text/event-stream": {"schema": {"$ref": "#/components/schemas/ResponseStreamEvent"}}},
    ),
)
async def retrieve_response(
    response_id: str,
    request: Request,
    resources: ResourcesDep,
    stream: bool = False,
    starting_after: Annotated[int | None, Query(ge=-1, description="the sequence number to resume after")] = None,
) -> Response:
    owner = await _owner(request, resources)
    turns = turns_of(resources)
    background = background_of(resources)
    if not looks_like("resp_", response_id):
        raise response_not_found(response_id)
    if stream:
        if await background.state(owner, response_id) is None:
            if await turns.responses.get(owner, response_id, now_ms=resources.clock()) is not None:
                raise BadRequest("Only responses created with background=true can be streamed again.", param="stream")
            raise response_not_found(response_id)
        after = -1 if starting_after is None else starting_after
        return streaming_response(200, background.follow(owner, response_id, after), SSE, on_close=_nothing)
    row = await turns.responses.get(owner, response_id, now_ms=resources.clock())
    if row is not None:
        return bytes_response(200, completed(row.body), JSON)
    found = await background.state(owner, response_id)
    if found is None:
        raise response_not_found(response_id)
    return bytes_response(200, found[1], JSON)


@router.post(
    "/v1/responses/{response_id}/cancel",
    responses=schemas.ok(
        schemas.Response, "the background Response as it ended (cancelled, or as it finished before the cancel)"
    ),
)
async def cancel_response(response_id: str, request: Request, resources: ResourcesDep) -> Response:
    owner = await _owner(request, resources)
    background = background_of(resources)
    if not looks_like("resp_", response_id):
        raise response_not_found(response_id)
    return bytes_response(200, await background.cancel(owner, response_id), JSON)


@router.delete(
    "/v1/responses/{response_id}",
    openapi_extra=with_key({}),
    responses=schemas.ok(schemas.ResponseDeleted, "deleted, with its descendants' cache"),
)
async def delete_response(response_id: str, request: Request, resources: ResourcesDep) -> Response:
    principal = await resources.authenticator.authenticate(request.headers.raw)
    owner = principal.owner
    turns = turns_of(resources)
    background = background_of(resources)
    deleted = json_response({"id": response_id, "object": "response.deleted", "deleted": True})

    async def run(_intended: str) -> Response:
        tree = (
            await turns.responses.delete(owner, response_id, now_ms=resources.clock())
            if looks_like("resp_", response_id)
            else None
        )
        forgotten = await background.forget(owner, response_id) if looks_like("resp_", response_id) else False
        if tree is None and not forgotten:
            raise response_not_found(response_id)
        await resources.retention.forget_in_cache([cache_key(i) for i in tree or ()])
        return deleted

    async def recover(_intended: str) -> Outcome | None:
        # The first attempt ended without an outcome: the response gone, it was deleted.
        if await turns.responses.get(owner, response_id, now_ms=resources.clock()) is not None:
            return None
        return None if await background.state(owner, response_id) is not None else outcome_of(deleted)

    return await write_once(
        resources.idempotency,
        principal,
        request.headers.raw,
        route=f"DELETE /v1/responses/{response_id}",
        body=b"",
        intended=response_id,
        run=run,
        recover=recover,
    )


def page(bodies: list[bytes], has_more: bool) -> Response:
    """An OpenAI list page from stored item bodies, joined without parsing them again."""
    first = orjson.loads(bodies[0])["id"] if bodies else None
    last = orjson.loads(bodies[-1])["id"] if bodies else None
    head = orjson.dumps({"object": "list", "first_id": first, "last_id": last, "has_more": has_more})
    return bytes_response(200, head[:-1] + b',"data":[' + b",".join(bodies) + b"]}", JSON)


def list_params(request: Request) -> tuple[bool, str | None, int]:
    query = request.query_params
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadRequest("Invalid 'order': 'asc' or 'desc'.", param="order", code="invalid_value")
    raw_limit = query.get("limit", "20")
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= 100:
        raise BadRequest("Invalid 'limit': between 1 and 100.", param="limit", code="invalid_value")
    return order == "desc", query.get("after"), int(raw_limit)


@router.get(
    "/v1/responses/{response_id}/input_items",
    responses=schemas.ok(
        schemas.ItemList, "the response's own input items (on a conversation: those still in the conversation)"
    ),
    openapi_extra=schemas.LIST_PARAMETERS,
)
async def list_input_items(response_id: str, request: Request, resources: ResourcesDep) -> Response:
    owner = await _owner(request, resources)
    descending, after, limit = list_params(request)
    turns = turns_of(resources)
    now = resources.clock()
    bodies = (
        await turns.responses.input_items(owner, response_id, now_ms=now) if looks_like("resp_", response_id) else None
    )
    if bodies is None:
        raise response_not_found(response_id)
    if descending:
        bodies.reverse()
    if after is not None:
        ids = [orjson.loads(b)["id"] for b in bodies]
        bodies = bodies[ids.index(after) + 1 :] if after in ids else bodies
    return page(bodies[:limit], len(bodies) > limit)
