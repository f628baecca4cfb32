"""A threaded turn sent with an `Idempotency-Key` (docs/protocol.md §11): `POST /v1/messages` with `thread` or a
session header, stored once under its key whatever the retries, and a retry answered with the first outcome (the
same message id and body, a stream replayed as its events). The rules are the core's (statestore/core/idempotency.py),
as on the Responses door; this module says which reply id the turn stores and how a retry finds it stored."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

from statestore.api.idempotent import keyed_write
from statestore.api.threaded import serve_threaded_turn
from statestore.auth import Principal
from statestore.core.idempotency import Claim, Outcome
from statestore.errors import IdempotencyKeyInFlight, ThreadContinueInFlight
from statestore.resources import Resources
from statestore.store.thread_reads import StoredReply
from statestore.threads.ids import new_response_id, new_thread_id, thread_of_response
from statestore.threads.prepared import rfc3339
from statestore.threads.turn import ThreadTurn
from statestore.upstream.wire import JSON_CONTENT_TYPE, SSE_CONTENT_TYPE, message_events

ROUTE = "POST /v1/messages"


async def keyed_turn(
    resources: Resources,
    turn: ThreadTurn,
    principal: Principal,
    *,
    headers: list[tuple[bytes, bytes]],
    query: str,
    body: bytes,
    raw_key: bytes,
) -> Response:
    owner = principal.owner
    # The reply's id, named under the key before anything is stored. A continue's thread is known now; a create's is
    # the one this id names. A session turn's thread is known only once its head is taken: its id is named anew then.
    continued = thread_of_response(turn.previous_message_id) if turn.previous_message_id is not None else None
    proposed = new_response_id(continued or new_thread_id())

    async def run(claim: Claim) -> Response:
        async def begun(response_id: str, user_id: str | None) -> None:
            # The key goes with the thread's user (a continue that names none is the thread's), whose erasure erases it.
            if response_id != claim.intended or user_id != claim.request.user_id:
                await resources.idempotency.intend(claim, response_id, user_id=user_id)

        # Run again after an attempt that failed, a continue goes on under the id its key names; a create or a session
        # turn takes a new thread (the first attempt's, if any, was dropped) and names its reply anew.
        try:
            return await serve_threaded_turn(
                resources.threads,
                resources.upstream,
                turn=turn,
                principal=principal,
                headers=headers,
                query=query,
                response_id=claim.intended if turn.mode == "continue" else proposed,
                begun=begun,
            )
        except ThreadContinueInFlight as exc:
            # The head may be held by this key's own first attempt, outliving its claim: forgetting the key now would
            # let a later retry store the turn again, so the retry is told to come back (the key keeps its ids).
            raise IdempotencyKeyInFlight(
                f"A request with Idempotency-Key '{claim.request.key}' is still being processed."
            ) from exc

    async def recover(intended: str) -> Outcome | None:
        thread_id = thread_of_response(intended)
        if thread_id is None:
            return None
        stored = await resources.queries.stored_reply(owner, thread_id, intended, now_ms=resources.clock())
        return None if stored is None else rebuilt(turn, stored, response_id=intended, thread_id=thread_id)

    return await keyed_write(
        resources.idempotency,
        principal,
        raw_key,
        route=ROUTE,
        body=body,
        # What shapes the turn besides its body: the session it continues, its TTL, its betas.
        shaping=(
            turn.session.encode() if turn.session is not None else None,
            turn.ttl_header,
            turn.anthropic_beta.encode(),
        ),
        intended=proposed,
        run=run,
        recover=recover,
    )


def rebuilt(turn: ThreadTurn, stored: StoredReply, *, response_id: str, thread_id: str) -> Outcome:
    """The answer of a turn found stored whose first outcome was never kept (its replica stopped, or the database went
    away, between the commit and keeping it): the Message with the reply's id and content as stored; what the thread
    does not keep of a reply is given as docs/protocol.md §11 says (the request's model, a stop_reason read from the
    content, usage 0)."""
    content: Any = orjson.loads(stored.body).get("content", [])
    blocks = content if isinstance(content, list) else [{"type": "text", "text": content}]
    model = turn.fields.get("model")
    message = {
        "id": response_id,
        "type": "message",
        "role": "assistant",
        "model": model if isinstance(model, str) else stored.model or "",
        "content": blocks,
        "stop_reason": "tool_use" if any(block.get("type") == "tool_use" for block in blocks) else "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 0, "output_tokens": 0},
    }
    named = [(b"statestore-thread-id", thread_id.encode()), (b"statestore-expires-at", rfc3339(stored.expires_ms))]
    if turn.session is not None:
        named.append((b"statestore-session-id", turn.session.encode()))
    if turn.stream:
        events = b"".join(message_events(message))
        return Outcome(status=200, headers=((b"content-type", SSE_CONTENT_TYPE), *named), body=events, streamed=True)
    return Outcome(status=200, headers=((b"content-type", JSON_CONTENT_TYPE), *named), body=orjson.dumps(message))
