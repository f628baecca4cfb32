"""A count of the tokens a threaded turn would send (docs/protocol.md §11): the request rebuilt as `ThreadService.begin`
rebuilds it (stored system, tools and messages, the owner's context policy, then the new messages), read without
taking the head. Nothing is held and nothing is written (not even the cache), so a count never waits for a continue in
flight, nor makes one wait.

A `summarize` policy whose trigger the turn passes is counted as its fallback, `truncate`: a count never calls the
model, and the summary it would ask for does not exist yet."""

from __future__ import annotations

from collections.abc import Iterable

import orjson

from statestore.auth import Principal
from statestore.core import planner
from statestore.errors import (
    InternalError,
    InvalidRequest,
    ServiceUnavailable,
    ThreadContinueInFlight,
    ThreadNotFound,
)
from statestore.policy import Policy
from statestore.records import record
from statestore.store.cache_entry import thread_key
from statestore.store.engine import DATABASE_ERRORS, UNSTORABLE_VALUE_ERRORS
from statestore.store.turn_records import LeasedThread
from statestore.threads import assembly, context, context_step, rules
from statestore.threads.diagnostics import minted_previous_id, rewrite_previous_id
from statestore.threads.ids import thread_of_response
from statestore.threads.refusal_retry import with_window
from statestore.threads.service import ThreadService
from statestore.threads.turn import ThreadTurn

# A continue that commits while a count reads its thread leaves the rows ahead of the row read first: the count reads
# again (a count by response id then finds its id continued already), a few times before it gives up.
_READS = 3


@record
class CountedRequest:
    body: bytes  # the request the turn would send, as `count_tokens` takes it
    estimate: int  # statestore's estimate of its tokens (the context planner's, core/planner.py)


class _Moved(Exception):
    """The thread's head moved while the count read it."""


async def counted_request(
    service: ThreadService, turn: ThreadTurn, principal: Principal, headers: Iterable[tuple[bytes, bytes]]
) -> CountedRequest:
    """The request `turn` would send now, and the estimate of its tokens. Raises the errors the turn would get (a
    thread error, 400, 413, 503) before it is sent."""
    try:
        policy = await with_window(
            service.windows, await service.policies.for_tenant(principal.tenant_id), turn, headers, principal
        )
        rules.check_policy(policy, turn)
        if minted_previous_id(turn.fields) is not None:
            await rewrite_previous_id(
                turn.fields, owner=principal.owner, store=service.repository, now_ms=service.clock()
            )
        for _ in range(_READS):
            try:
                return await _request(service, turn, principal.owner, policy)
            except _Moved:
                continue
        raise ThreadContinueInFlight("the thread moved on while it was counted; count again")
    except orjson.JSONEncodeError as exc:
        raise InvalidRequest("the request cannot be stored: nested too deeply or holds an unsupported value") from exc
    except UNSTORABLE_VALUE_ERRORS as exc:
        raise InvalidRequest("the request holds a value the thread store cannot keep") from exc
    except DATABASE_ERRORS as exc:
        raise ServiceUnavailable("the thread store is unavailable; try again shortly") from exc


async def _read(service: ThreadService, turn: ThreadTurn, owner: str) -> LeasedThread | None:
    """The thread the turn continues (raising the refusal a continue would get), or None: a create."""
    now = service.clock()
    repository = service.repository
    if turn.mode == "continue":
        assert turn.previous_message_id is not None
        thread_id = thread_of_response(turn.previous_message_id)
        if thread_id is None:
            raise ThreadNotFound("no thread has a response with this id")
        found = await repository.read_by_response(
            owner=owner, thread_id=thread_id, response_id=turn.previous_message_id, now_ms=now
        )
        if found is None:
            reason = await repository.why_not_continuable(
                owner=owner, thread_id=thread_id, response_id=turn.previous_message_id, now_ms=now
            )
            if reason == "in_flight":  # the head is this id after all: it moved back and forth while read
                raise _Moved
            raise rules.refusal(reason)
        return found
    if turn.mode == "session":
        assert turn.session is not None
        return await repository.read_by_session(owner=owner, session=turn.session, now_ms=now)
    return None


async def _request(service: ThreadService, turn: ThreadTurn, owner: str, policy: Policy) -> CountedRequest:
    leased = await _read(service, turn, owner)
    if leased is None:
        return _created(turn, policy)
    try:
        return await _continued(service, leased, turn, policy)
    except InternalError:
        # The rows disagree with the row read before them: a turn committed in between, or the thread is broken.
        again = await _read(service, turn, owner)
        if again is None or again.head_position == leased.head_position:
            raise
        raise _Moved from None


def _new_bytes(forwarded: list[bytes]) -> int:
    return sum(map(len, forwarded)) + len(forwarded)


def _created(turn: ThreadTurn, policy: Policy) -> CountedRequest:
    system = turn.system if turn.has_system else None
    tools = turn.tools if turn.has_tools else None
    new = assembly.encode_new_messages(turn.messages)
    rules.check_markers(assembly.count_cache_markers(system) + assembly.count_tool_markers(tools) + new.markers)
    system_bytes = assembly.encode(system) if turn.has_system else None
    tools_bytes = assembly.encode(tools) if turn.has_tools else None
    fixed = len(system_bytes or b"") + len(tools_bytes or b"")
    rules.check_limits(
        policy, messages=len(new.stored) + 1, size=fixed + sum(map(len, new.stored)), ttl_header=None, current_ttl=None
    )
    body = assembly.build_body(
        turn.fields, system=system_bytes, tools=tools_bytes, history=b"", new_messages=new.forwarded
    )
    estimate = planner.estimate(
        known_tokens=0,
        known_bytes=fixed,
        new_bytes=_new_bytes(new.forwarded),
        ratio=planner.DEFAULT_TOKENS_PER_BYTE,
    )
    return CountedRequest(body, estimate)


async def _continued(service: ThreadService, leased: LeasedThread, turn: ThreadTurn, policy: Policy) -> CountedRequest:
    rules.check_fixed_fields(leased, turn)
    new = assembly.encode_new_messages(turn.messages)
    rules.check_markers(leased.fixed_markers + new.markers)
    fixed = len(leased.system or b"") + len(leased.tools or b"")
    new_bytes = _new_bytes(new.forwarded)
    moved = None
    if policy.context_strategy != "none":
        moved = await context_step.step(service.repository, leased, turn, policy, new.forwarded, summarize=None)
    rules.check_limits(
        policy,
        messages=(moved.messages if moved else leased.context_messages) + len(new.stored) + 1,
        size=fixed + (moved.size if moved else leased.context_bytes) + sum(map(len, new.stored)),
        ttl_header=None,
        current_ttl=None,
    )
    if moved is not None:
        history = moved.joined
        estimate = planner.estimate(
            known_tokens=0,
            known_bytes=fixed + moved.size,
            new_bytes=new_bytes,
            ratio=context.tokens_per_byte(leased, fixed),
        )
    else:
        history = await _history(service, leased)
        estimate = context.estimate(leased, fixed, new_bytes)
    body = assembly.build_body(
        turn.fields, system=leased.system, tools=leased.tools, history=history, new_messages=new.forwarded
    )
    return CountedRequest(body, estimate)


async def _history(service: ThreadService, leased: LeasedThread) -> bytes:
    """The thread's context as a rebuild joins it: the cache's entry at the head's position, else the database's rows
    (the cache is left as it is: only a commit writes it)."""
    cached = await service.cache.get(thread_key(leased.id))
    if cached is not None and cached.count == leased.head_position:
        return cached.joined
    rows = await service.repository.load_context(leased.id, owner=leased.owner)
    if sum(1 for position, _ in rows if position >= 0) != leased.head_position - leased.base_position:
        raise InternalError("the stored thread is inconsistent")
    return assembly.join_history([body for _, body in rows])
