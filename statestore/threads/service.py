"""The threaded turn: take the head, rebuild the request, forward it, and commit the reply before its end reaches the
client (PROTOCOL §2 to §6). A turn is all or nothing: any failure gives the head back and stores nothing."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

import anyio
import orjson
from sqlalchemy.exc import DataError
from starlette.responses import Response

from statestore.api.responses import bytes_response, streaming_response
from statestore.auth import Principal
from statestore.errors import (
    InternalError,
    InvalidRequest,
    RequestTooLarge,
    ServiceUnavailable,
    StatestoreError,
    StreamBrokenOff,
    ThreadAlreadyContinued,
    ThreadContinueInFlight,
    ThreadFingerprintMismatch,
    ThreadNotFound,
    ThreadUnsupportedRequest,
)
from statestore.metrics import Metrics
from statestore.store.cache import CachedHistory, HistoryCache
from statestore.store.repository import (
    DATABASE_ERRORS,
    LeasedThread,
    NewThread,
    ThreadRepository,
    TurnCommit,
    TurnUsage,
)
from statestore.threads import assembly
from statestore.threads.diagnostics import minted_previous_id, rewrite_previous_id, storable_backend_id
from statestore.threads.ids import new_lease_token, new_response_id, new_thread_id, thread_of_response
from statestore.threads.policy import Policy
from statestore.threads.policy_store import PolicyStore
from statestore.threads.turn import ThreadTurn
from statestore.threads.usage import usage_of
from statestore.upstream.client import (
    StreamInterrupted,
    UpstreamClient,
    request_headers_for_upstream,
    response_headers_for_client,
)
from statestore.upstream.sse import ReplyAccumulator, SSEParser

log = logging.getLogger(__name__)

MAX_CACHE_MARKERS = 3


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(slots=True)
class PreparedTurn:
    """A turn holding the thread head: what to forward, and what to store if the reply completes."""

    thread_id: str
    lease_token: str
    creating: bool
    start_position: int
    new_rows: list[bytes]
    response_id: str
    ttl_seconds: int
    expires_ms: int
    session: str | None
    metadata_user_id: str | None
    upstream_body: bytes
    history_count: int
    anthropic_beta: str
    renewal: asyncio.Task[None] | None = None
    outcome: str = field(default="not_stored")
    # An explicit create that names a session: (owner, name), bound to this thread when its reply commits (PROTOCOL §6).
    rebind_session: tuple[str, str] | None = None


def _storable(message: dict[str, Any]) -> bool:
    """Refusals and replies a fallback model wrote are returned but not stored (PROTOCOL §2)."""
    if message.get("stop_reason") == "refusal":
        return False
    usage = message.get("usage")
    iterations = usage.get("iterations") if isinstance(usage, dict) else None
    return not (
        isinstance(iterations, list)
        and any(isinstance(it, dict) and it.get("type") == "fallback_message" for it in iterations)
    )


def _rfc3339(ms: int) -> bytes:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="seconds").replace("+00:00", "Z").encode()


class ThreadService:
    def __init__(
        self,
        *,
        repository: ThreadRepository,
        cache: HistoryCache,
        upstream: UpstreamClient,
        policies: PolicyStore,
        lease_seconds: int,
        metrics: Metrics,
        clock: Callable[[], int] = wall_clock_ms,
    ) -> None:
        self.metrics = metrics
        self.repository = repository
        self.cache = cache
        self.upstream = upstream
        self.policies = policies
        self.lease_ms = lease_seconds * 1000
        self.clock = clock

    async def handle(
        self, turn: ThreadTurn, principal: Principal, headers: list[tuple[bytes, bytes]], query: str
    ) -> Response:
        try:
            policy = await self.policies.for_tenant(principal.tenant_id)
        except DATABASE_ERRORS as exc:
            raise ServiceUnavailable("the thread store is unavailable; try again shortly") from exc
        if not policy.threads_enabled:
            raise ThreadUnsupportedRequest("threads are turned off for this owner", unsupported=[])
        if turn.session is not None and not policy.sessions_enabled:
            raise ThreadUnsupportedRequest("sessions are turned off for this owner", unsupported=[])
        kind: Literal["create", "continue"] = "continue" if turn.mode == "continue" else "create"
        try:
            prepared = await self._prepare(turn, principal, policy)
        except StatestoreError:
            self.metrics.count_thread_turn(kind, "rejected")
            raise
        except orjson.JSONEncodeError as exc:
            # orjson writes at most 254 levels of nesting, though it reads more.
            self.metrics.count_thread_turn(kind, "rejected")
            raise InvalidRequest(
                "the request cannot be stored: nested too deeply or holds an unsupported value"
            ) from exc
        except DataError as exc:
            self.metrics.count_thread_turn(kind, "rejected")
            raise InvalidRequest("the request holds a value the thread store cannot keep") from exc
        except DATABASE_ERRORS as exc:
            self.metrics.count_thread_turn(kind, "rejected")
            log.warning("database unavailable for a threaded turn", extra={"error": type(exc).__name__})
            raise ServiceUnavailable("the thread store is unavailable; try again shortly") from exc
        # A long reply outlives the lease; renewing it keeps a crashed request's lease short and a live one held.
        prepared.renewal = asyncio.create_task(self._keep_lease(prepared), name="lease-renewal")
        try:
            return await self._forward(prepared, principal, headers, query)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._give_back(prepared)
            raise

    # -- taking the head ---------------------------------------------------------------------------------------

    async def _prepare(self, turn: ThreadTurn, principal: Principal, policy: Policy) -> PreparedTurn:
        owner = principal.owner
        now = self.clock()
        token = new_lease_token()
        if minted_previous_id(turn.fields) is not None:
            await rewrite_previous_id(turn.fields, owner=owner, store=self.repository, now_ms=now)
        if turn.mode == "continue":
            assert turn.previous_message_id is not None
            thread_id = thread_of_response(turn.previous_message_id)
            if thread_id is None:
                raise ThreadNotFound("no thread has a response with this id")
            # The cached history is read while the lease is taken: its count is checked against the head after.
            leased, cached = await asyncio.gather(
                self.repository.acquire_by_response(
                    owner=owner,
                    thread_id=thread_id,
                    response_id=turn.previous_message_id,
                    token=token,
                    now_ms=now,
                    lease_until_ms=now + self.lease_ms,
                ),
                self.cache.get(thread_id),
            )
            if leased is None:
                reason = await self.repository.why_not_continuable(
                    owner=owner, thread_id=thread_id, response_id=turn.previous_message_id, now_ms=now
                )
                raise _refusal(reason)
            return await self._continue(leased, token, turn, policy, now, cached=cached, prefetched=True)
        if turn.mode == "session":
            assert turn.session is not None
            leased = await self.repository.acquire_by_session(
                owner=owner, session=turn.session, token=token, now_ms=now, lease_until_ms=now + self.lease_ms
            )
            if leased is not None:
                return await self._continue(leased, token, turn, policy, now)
            if await self.repository.session_is_busy(owner=owner, session=turn.session, now_ms=now):
                raise ThreadContinueInFlight("another request is continuing this session right now")
        return await self._create(principal, token, turn, policy, now)

    async def _create(
        self, principal: Principal, token: str, turn: ThreadTurn, policy: Policy, now: int
    ) -> PreparedTurn:
        system = turn.system if turn.has_system else None
        tools = turn.tools if turn.has_tools else None
        fixed_markers = assembly.count_cache_markers(system) + assembly.count_tool_markers(tools)
        _check_markers(fixed_markers + assembly.count_cache_markers(turn.messages))
        system_bytes = assembly.encode(system) if turn.has_system else None
        tools_bytes = assembly.encode(tools) if turn.has_tools else None
        new_rows = [assembly.stored_message(m) for m in turn.messages]
        fixed_bytes = len(system_bytes or b"") + len(tools_bytes or b"")
        _check_limits(policy, messages=len(new_rows) + 1, size=fixed_bytes + sum(map(len, new_rows)))
        ttl = policy.ttl_for(turn.ttl_header, None)
        thread = NewThread(
            id=new_thread_id(),
            owner=principal.owner,
            tenant_id=principal.tenant_id,
            session_id=turn.session,
            metadata_user_id=turn.metadata_user_id,
            system=system_bytes,
            tools=tools_bytes,
            system_fp=assembly.fingerprint(system),
            tools_fp=assembly.fingerprint(tools),
            output_config_fp=assembly.fingerprint(turn.fields.get("output_config")),
            fixed_markers=fixed_markers,
            ttl_seconds=ttl,
        )
        # A `thread` field wins over the session header: an explicit create takes the name even from a live thread,
        # but only once its reply commits, so a create that fails leaves the name where it was (PROTOCOL §6).
        explicit = turn.mode == "create"
        # Built before anything is written, so a body that cannot be encoded leaves no row behind.
        body = assembly.build_body(
            turn.fields,
            system=system_bytes,
            tools=tools_bytes,
            history=b"",
            new_messages=[assembly.encode(m) for m in turn.messages],
        )
        if not await self.repository.begin_create(
            thread, token=token, now_ms=now, lease_until_ms=now + self.lease_ms, bind_session=not explicit
        ):
            raise ThreadContinueInFlight("another request is continuing this session right now")
        return PreparedTurn(
            thread_id=thread.id,
            lease_token=token,
            creating=True,
            start_position=0,
            new_rows=new_rows,
            response_id=new_response_id(thread.id),
            ttl_seconds=ttl,
            expires_ms=now + ttl * 1000,
            session=turn.session,
            metadata_user_id=turn.metadata_user_id,
            upstream_body=body,
            history_count=0,
            anthropic_beta=turn.anthropic_beta,
            rebind_session=(principal.owner, turn.session) if explicit and turn.session is not None else None,
        )

    async def _continue(
        self,
        leased: LeasedThread,
        token: str,
        turn: ThreadTurn,
        policy: Policy,
        now: int,
        *,
        cached: CachedHistory | None = None,
        prefetched: bool = False,
    ) -> PreparedTurn:
        try:
            _check_fixed_fields(leased, turn)
            _check_markers(leased.fixed_markers + assembly.count_cache_markers(turn.messages))
            new_rows = [assembly.stored_message(m) for m in turn.messages]
            _check_limits(
                policy,
                messages=leased.head_position + len(new_rows) + 1,
                size=len(leased.system or b"") + len(leased.tools or b"") + leased.byte_count + sum(map(len, new_rows)),
            )
            ttl = policy.ttl_for(turn.ttl_header, leased.ttl_seconds)
            if not prefetched:
                cached = await self.cache.get(leased.id)
            history = await self._history(leased, cached, ttl_ms=ttl * 1000)
            body = assembly.build_body(
                turn.fields,
                system=leased.system,
                tools=leased.tools,
                history=history,
                new_messages=[assembly.encode(m) for m in turn.messages],
            )
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._release_quietly(leased.id, token)
            raise
        return PreparedTurn(
            thread_id=leased.id,
            lease_token=token,
            creating=False,
            start_position=leased.head_position,
            new_rows=new_rows,
            response_id=new_response_id(leased.id),
            ttl_seconds=ttl,
            expires_ms=now + ttl * 1000,
            session=turn.session,
            metadata_user_id=turn.metadata_user_id,
            upstream_body=body,
            history_count=leased.head_position,
            anthropic_beta=turn.anthropic_beta,
        )

    async def _history(self, leased: LeasedThread, cached: CachedHistory | None, *, ttl_ms: int) -> bytes:
        """The stored messages, pre-joined: from the cache when it holds exactly the thread's messages, else rebuilt
        from the database (and the cache refilled)."""
        if cached is not None and cached.count == leased.head_position:
            self.metrics.count_cache_lookup("hit")
            return cached.joined
        self.metrics.count_cache_lookup("miss" if cached is None else "stale")
        rows = await self.repository.load_history(leased.id)
        if len(rows) != leased.head_position:
            log.error(
                "thread rows disagree with its head position",
                extra={"thread_id": leased.id, "rows": len(rows), "head_position": leased.head_position},
            )
            raise InternalError("the stored thread is inconsistent")
        joined = assembly.join_history(rows)
        await self.cache.put(leased.id, CachedHistory(len(rows), joined), ttl_ms)
        return joined

    # -- forwarding and committing -----------------------------------------------------------------------------

    def _thread_headers(self, prepared: PreparedTurn) -> list[tuple[bytes, bytes]]:
        headers = [
            (b"statestore-thread-id", prepared.thread_id.encode()),
            (b"statestore-expires-at", _rfc3339(prepared.expires_ms)),
        ]
        if prepared.session is not None:
            headers.append((b"statestore-session-id", prepared.session.encode()))
        return headers

    async def _forward(
        self, prepared: PreparedTurn, principal: Principal, headers: list[tuple[bytes, bytes]], query: str
    ) -> Response:
        upstream_headers = request_headers_for_upstream(
            headers, threaded=True, credential=principal.upstream_credential
        )
        path = "/v1/messages" + (f"?{query}" if query else "")
        response = await self.upstream.send("POST", path, upstream_headers, prepared.upstream_body)
        content_type = response.header(b"content-type") or b""
        if response.status != 200 or not content_type.startswith(b"text/event-stream"):
            try:
                body = await response.read()
            finally:
                await response.aclose()
            if response.status != 200:
                await self._give_back(prepared)
                return bytes_response(
                    response.status, body, response_headers_for_client(response.headers, keep_length=False)
                )
            return await self._complete_json(prepared, response.headers, body)

        async def settle() -> None:
            await response.aclose()
            await self._give_back(prepared)  # no-op once the turn is stored or given back

        return streaming_response(
            200,
            self._relay_stream(prepared, response),
            response_headers_for_client(response.headers, keep_length=False) + self._thread_headers(prepared),
            on_close=settle,
        )

    async def _complete_json(
        self, prepared: PreparedTurn, upstream_headers: list[tuple[bytes, bytes]], body: bytes
    ) -> Response:
        try:
            message = orjson.loads(body)
        except orjson.JSONDecodeError:
            message = None
        if not isinstance(message, dict) or message.get("type") != "message":
            # Not a Message: relay it as it came, store nothing.
            await self._give_back(prepared)
            return bytes_response(200, body, response_headers_for_client(upstream_headers, keep_length=False))
        backend_id = message.get("id")
        message["id"] = prepared.response_id
        headers = response_headers_for_client(upstream_headers, keep_length=False)
        if _storable(message):
            await self._commit(
                prepared,
                assembly.stored_reply(message.get("content", [])),
                backend_id=storable_backend_id(backend_id),
                usage=usage_of(message),
            )
            headers += self._thread_headers(prepared)
        else:
            # Returned but not stored: no thread to name (a create's row is gone; a continue's head did not move).
            await self._give_back(prepared)
        return bytes_response(200, orjson.dumps(message), headers)

    async def _relay_stream(self, prepared: PreparedTurn, response: Any) -> AsyncIterator[bytes]:
        parser = SSEParser()
        reply = ReplyAccumulator(prepared.response_id, anthropic_beta=prepared.anthropic_beta)
        done = False
        try:
            async for chunk in response.chunks():
                out: list[bytes] = []
                for event in parser.feed(chunk):
                    if event.event == "message_stop":
                        # The end of the reply leaves only after the turn is durable.
                        captured = reply.message_started and not reply.error_seen and reply.failure is None
                        if not captured or not _storable(reply.message):
                            with anyio.CancelScope(shield=True):
                                await self._give_back(prepared)
                        else:
                            with anyio.CancelScope(shield=True):
                                await self._commit(
                                    prepared,
                                    assembly.stored_reply(reply.message.get("content", [])),
                                    backend_id=storable_backend_id(reply.backend_id),
                                    usage=usage_of(reply.message),
                                )
                        done = True
                    out.append(reply.add(event))
                if out:
                    yield b"".join(out)
        except StreamInterrupted as exc:
            raise StreamBrokenOff(f"the backend stream broke off ({type(exc).__name__}); nothing stored") from exc
        except StatestoreError as exc:
            raise StreamBrokenOff(f"the turn was not committed ({type(exc).__name__}); message_stop withheld") from exc
        finally:
            with anyio.CancelScope(shield=True):
                await response.aclose()
                if not done:
                    await self._give_back(prepared)

    async def _keep_lease(self, prepared: PreparedTurn) -> None:
        interval = self.lease_ms / 3000
        while True:
            await asyncio.sleep(interval)
            try:
                held = await self.repository.renew_lease(
                    thread_id=prepared.thread_id,
                    token=prepared.lease_token,
                    lease_until_ms=self.clock() + self.lease_ms,
                )
            except DATABASE_ERRORS as exc:
                log.warning(
                    "could not renew a lease", extra={"thread_id": prepared.thread_id, "error": type(exc).__name__}
                )
                continue
            if not held:
                return

    @staticmethod
    def _stop_renewal(prepared: PreparedTurn) -> None:
        if prepared.renewal is not None:
            prepared.renewal.cancel()
            prepared.renewal = None

    async def _commit(
        self, prepared: PreparedTurn, reply_row: bytes, *, backend_id: str | None, usage: TurnUsage
    ) -> None:
        self._stop_renewal(prepared)
        rows: list[tuple[bytes, str | None]] = [(body, None) for body in prepared.new_rows]
        rows.append((reply_row, prepared.response_id))
        now = self.clock()
        # The TTL runs from the stored reply (§5), however long the backend took; a stream's header, sent before
        # the reply, promised no later than this.
        prepared.expires_ms = now + prepared.ttl_seconds * 1000
        commit = TurnCommit(
            thread_id=prepared.thread_id,
            lease_token=prepared.lease_token,
            start_position=prepared.start_position,
            rows=rows,
            head_message_id=prepared.response_id,
            expires_ms=prepared.expires_ms,
            ttl_seconds=prepared.ttl_seconds,
            now_ms=now,
            metadata_user_id=prepared.metadata_user_id,
            rebind_session=prepared.rebind_session,
            reply_backend_id=backend_id,
            usage=usage,
        )
        try:
            committed = await self.repository.commit_turn(commit)
        except DATABASE_ERRORS as exc:
            log.warning("could not commit a turn", extra={"thread_id": prepared.thread_id, "error": type(exc).__name__})
            raise ServiceUnavailable("the thread store is unavailable; the turn was not stored") from exc
        if not committed:
            raise ThreadContinueInFlight("the lease on this thread ran out before the reply completed")
        prepared.outcome = "stored"
        self.metrics.count_thread_turn("create" if prepared.creating else "continue", "stored")
        ttl_ms = prepared.ttl_seconds * 1000
        added = [body for body, _ in rows]
        if prepared.creating:
            await self.cache.put(prepared.thread_id, CachedHistory(len(added), assembly.join_history(added)), ttl_ms)
        else:
            await self.cache.append(prepared.thread_id, prepared.history_count, added, ttl_ms)

    async def _give_back(self, prepared: PreparedTurn) -> None:
        self._stop_renewal(prepared)
        if prepared.outcome in {"stored", "given_back"}:
            return
        prepared.outcome = "given_back"
        self.metrics.count_thread_turn("create" if prepared.creating else "continue", "not_stored")
        try:
            if prepared.creating:
                await self.repository.abandon_create(thread_id=prepared.thread_id, token=prepared.lease_token)
            else:
                await self.repository.release(thread_id=prepared.thread_id, token=prepared.lease_token)
        except DATABASE_ERRORS as exc:
            # The lease still runs out by itself; the thread stays continuable after that.
            log.warning(
                "could not release a lease", extra={"thread_id": prepared.thread_id, "error": type(exc).__name__}
            )

    async def _release_quietly(self, thread_id: str, token: str) -> None:
        try:
            await self.repository.release(thread_id=thread_id, token=token)
        except DATABASE_ERRORS as exc:
            log.warning("could not release a lease", extra={"thread_id": thread_id, "error": type(exc).__name__})


def _refusal(reason: str) -> StatestoreError:
    if reason == "already_continued":
        return ThreadAlreadyContinued("this response id is not the thread's latest response; continue from the latest")
    if reason == "in_flight":
        return ThreadContinueInFlight("another request is continuing from this response id right now")
    return ThreadNotFound("no live thread has a response with this id")


def _check_markers(count: int) -> None:
    if count > MAX_CACHE_MARKERS:
        raise ThreadUnsupportedRequest(
            f"a thread request may carry at most {MAX_CACHE_MARKERS} block cache_control markers, stored ones "
            f"included; this one has {count}",
            unsupported=["cache_control"],
        )


def _check_limits(policy: Policy, *, messages: int, size: int) -> None:
    if messages > policy.max_messages:
        raise InvalidRequest(f"the thread would exceed its limit of {policy.max_messages} messages")
    if size > policy.max_thread_bytes:
        raise RequestTooLarge(f"the thread would exceed its limit of {policy.max_thread_bytes} bytes")


def _check_fixed_fields(leased: LeasedThread, turn: ThreadTurn) -> None:
    differing = []
    if turn.has_system and assembly.fingerprint(turn.system) != leased.system_fp:
        differing.append("system")
    if turn.has_tools and assembly.fingerprint(turn.tools) != leased.tools_fp:
        differing.append("tools")
    if assembly.fingerprint(turn.fields.get("output_config")) != leased.output_config_fp:
        differing.append("output_config")
    if differing:
        raise ThreadFingerprintMismatch(
            "these fields differ from the ones the thread was created with: "
            + ", ".join(differing)
            + "; send the stored values, or replay the conversation with a new thread to change them"
        )
