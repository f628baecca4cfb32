"""The owner's thread API (docs/protocol.md §7): list, inspect, export, delete; sessions. Same credentials as
`/v1/messages`; another owner's thread is 404, never 403."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

import orjson
from fastapi import APIRouter, Depends, Query, Request
from starlette.responses import Response

from statestore.api import schemas
from statestore.api.deps import ResourcesDep
from statestore.api.idempotent import outcome_of, with_key, write_once
from statestore.api.responses import bytes_response
from statestore.auth import Principal
from statestore.core.idempotency import Outcome
from statestore.errors import InvalidRequest, NotFound
from statestore.store.thread_reads import ThreadInfo
from statestore.threads.ids import is_thread_id

router = APIRouter(tags=["threads"], responses=schemas.error_responses(400, 401, 404, 503))
_SESSION_NAME = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_JSON = [(b"content-type", b"application/json")]


async def principal(request: Request, resources: ResourcesDep) -> Principal:
    return await resources.authenticator.authenticate(request.headers.raw)


Caller = Annotated[Principal, Depends(principal)]


def _time(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _thread(info: ThreadInfo) -> dict[str, Any]:
    return {
        "id": info.id,
        "type": "thread",
        "created_at": _time(info.created_ms),
        "last_used_at": _time(info.updated_ms),
        "expires_at": _time(info.expires_ms),
        "message_count": info.message_count,
        "turn_count": info.turn_count,
        "bytes": info.byte_count,
        "session_id": info.session_id,
        "head_message_id": info.head_message_id,
        # The backend's usage of the stored turns, added up (docs/protocol.md §10).
        "usage": {
            "input_tokens": info.usage.input_tokens,
            "output_tokens": info.usage.output_tokens,
            "cache_creation_input_tokens": info.usage.cache_creation_input_tokens,
            "cache_read_input_tokens": info.usage.cache_read_input_tokens,
            "turns": info.turn_count,
        },
        # What a rebuild sends (docs/protocol.md §9): the archive above holds every message, the context only these.
        "context": {
            "tokens": info.context.tokens,
            "base_position": info.context.base_position,
            "message_count": info.context.messages,
            "bytes": info.context.bytes,
            "compacted": info.context.compacted,
            "truncated": info.context.truncated,
            "summarized": info.context.summarized,
        },
    }


def _not_found(thread_id: str) -> NotFound:
    return NotFound(f"no live thread {thread_id!r}")


@router.get("/statestore/v1/threads", response_model=schemas.ThreadList)
async def list_threads(
    caller: Caller,
    resources: ResourcesDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
    after: str | None = None,
    session_id: str | None = None,
) -> dict[str, Any]:
    if after is not None and not is_thread_id(after):
        raise InvalidRequest("after: not a thread id")
    if session_id is not None and not _SESSION_NAME.fullmatch(session_id):
        raise InvalidRequest("session_id: 1-128 characters of A-Z, a-z, 0-9, '.', '_', ':', '-'")
    page = await resources.queries.list_threads(
        caller.owner, now_ms=resources.clock(), limit=limit, after=after, session_id=session_id
    )
    if page is None:
        raise InvalidRequest("after: no live thread with this id")
    items, has_more = page
    return {
        "data": [_thread(info) for info in items],
        "has_more": has_more,
        "first_id": items[0].id if items else None,
        "last_id": items[-1].id if items else None,
    }


@router.get("/statestore/v1/threads/{thread_id}", response_model=schemas.Thread)
async def get_thread(thread_id: str, caller: Caller, resources: ResourcesDep) -> dict[str, Any]:
    info = (
        await resources.queries.thread_info(caller.owner, thread_id, now_ms=resources.clock())
        if is_thread_id(thread_id)
        else None
    )
    if info is None:
        raise _not_found(thread_id)
    return _thread(info)


@router.get(
    "/statestore/v1/threads/{thread_id}/messages",
    response_class=Response,
    responses={200: {"model": schemas.ThreadExport, "description": "the thread as a Messages API request body"}},
)
async def export_thread(
    thread_id: str,
    caller: Caller,
    resources: ResourcesDep,
    view: Annotated[
        Literal["archive", "context"],
        Query(description="archive: every stored message; context: what the next turn sends (docs/protocol.md §9)"),
    ] = "archive",
) -> Response:
    exported = (
        await resources.queries.export(
            caller.owner, thread_id, now_ms=resources.clock(), context_only=view == "context"
        )
        if is_thread_id(thread_id)
        else None
    )
    if exported is None:
        raise _not_found(thread_id)
    # Stored bytes spliced as they are: the export is the request a client would send to replay the thread, so it
    # holds only Messages API fields (a real backend refuses any other, such as a thread id).
    parts = [b"{"]
    # The latest turn's model and max_tokens (threads stored before they were kept have none).
    if exported.model is not None:
        parts += [b'"model":', orjson.dumps(exported.model), b","]
    if exported.max_tokens is not None:
        parts += [b'"max_tokens":', str(exported.max_tokens).encode(), b","]
    if exported.system is not None:
        parts += [b'"system":', exported.system, b","]
    if exported.tools is not None:
        parts += [b'"tools":', exported.tools, b","]
    parts += [b'"messages":[', b",".join(exported.messages), b"]}"]
    return Response(b"".join(parts), media_type="application/json")


@router.delete(
    "/statestore/v1/threads/{thread_id}",
    response_model=schemas.ThreadDeleted,
    openapi_extra=with_key({}),
)
async def delete_thread(thread_id: str, request: Request, caller: Caller, resources: ResourcesDep) -> Response:
    deleted = bytes_response(200, orjson.dumps({"id": thread_id, "type": "thread_deleted"}), _JSON)

    async def run(_intended: str) -> Response:
        if not is_thread_id(thread_id) or not await resources.retention.delete_thread(caller.owner, thread_id):
            raise _not_found(thread_id)
        return deleted

    async def recover(_intended: str) -> Outcome | None:
        # The first attempt ended without an outcome: the thread gone, it was deleted.
        gone = await resources.queries.thread_info(caller.owner, thread_id, now_ms=resources.clock()) is None
        return outcome_of(deleted) if gone else None

    return await write_once(
        resources.idempotency,
        caller,
        request.headers.raw,
        route=f"DELETE /statestore/v1/threads/{thread_id}",
        body=b"",
        intended=thread_id,
        run=run,
        recover=recover,
    )


@router.get("/statestore/v1/sessions/{session_id}", response_model=schemas.Session)
async def get_session(session_id: str, caller: Caller, resources: ResourcesDep) -> dict[str, Any]:
    if not _SESSION_NAME.fullmatch(session_id):
        raise InvalidRequest("a session id is 1-128 characters of A-Z, a-z, 0-9, '.', '_', ':', '-'")
    info = await resources.queries.session_thread(caller.owner, session_id, now_ms=resources.clock())
    if info is None:
        raise NotFound(f"no live thread for session {session_id!r}")
    return {"id": session_id, "type": "session", "thread": _thread(info)}
