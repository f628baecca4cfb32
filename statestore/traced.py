"""The traced variants of the serving objects, used only when tracing is on (statestore/tracing.py).

A span per `POST /v1/messages` (SERVER, continuing the client's traceparent), with children for the lease
(`statestore.lease`, by `response`, `session`, `create`, or `claim` for a head claimed in Redis), the history read
(`statestore.history_read`: the cache, and the database on a miss), the backend call (`statestore.upstream`, CLIENT,
which carries traceparent to the backend) and the commit (`statestore.commit`). GenAI semantic-convention
attributes: gen_ai.system, gen_ai.operation.name, gen_ai.request.model, gen_ai.request.max_tokens,
gen_ai.usage.input_tokens / output_tokens. Never message content.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from urllib.parse import urlsplit

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer
from opentelemetry.util.types import AttributeValue
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from statestore.content_keys import ContentSealer
from statestore.core.leased_log import LeasedLog
from statestore.store.cache import HistoryCache
from statestore.store.cache_entry import CachedHistory, CacheKey
from statestore.store.lease_statements import LeaseStatements
from statestore.store.thread_claims import Claim, HeadClaims, Settle
from statestore.store.thread_store import ThreadStore
from statestore.store.turn_records import ContinueRefusal, HeadAfter, LeasedThread, NewThread, TurnCommit
from statestore.upstream.client import Upstream, UpstreamResponse

GENAI_SYSTEM = "anthropic"
# The rebuilt request puts the turn's fields first (threads/assembly.py), so the model is within the first bytes.
_MODEL = re.compile(rb'"model"\s*:\s*"([^"\\]{1,256})"')
_MODEL_SCAN_BYTES = 4096


class TracedClaims(HeadClaims):
    """A claim on a thread head (store/thread_claims.py) is the turn's lease (`statestore.lease`, by `claim`), and the
    same round trip reads the cached history (`statestore.history_read`, from the cache)."""

    __slots__ = ("_inner", "_tracer")

    def __init__(self, inner: HeadClaims, tracer: Tracer) -> None:
        self._inner = inner
        self._tracer = tracer

    async def claim(
        self, thread_id: str, *, owner: str, response_id: str, token: str, lease_ms: int, now_ms: int
    ) -> Claim:
        # Siblings under the request's span, as a leased turn's lease and history read are.
        read = self._tracer.start_span("statestore.history_read", attributes={"statestore.history.source": "cache"})
        try:
            with self._tracer.start_as_current_span("statestore.lease", attributes={"statestore.lease.by": "claim"}):
                claim = await self._inner.claim(
                    thread_id, owner=owner, response_id=response_id, token=token, lease_ms=lease_ms, now_ms=now_ms
                )
            read.set_attribute("statestore.cache.hit", claim.cached is not None)
            return claim
        finally:
            read.end()

    async def renew(self, thread_id: str, name: str, token: str, lease_ms: int) -> bool:
        return await self._inner.renew(thread_id, name, token, lease_ms)

    async def release(self, thread_id: str, name: str, token: str) -> None:
        await self._inner.release(thread_id, name, token)


class TracedLog(LeasedLog):
    """The leased log (core/leased_log.py) with a threaded turn's lease and commit in spans (docs/observability.md);
    a conversation's lease and a Responses commit run as they are, since spans are a threaded turn's."""

    __slots__ = ("_tracer",)

    def __init__(self, statements: LeaseStatements, tracer: Tracer) -> None:
        super().__init__(statements)
        self._tracer = tracer

    async def take_thread(
        self, *, owner: str, thread_id: str, head: str, token: str, now_ms: int, until_ms: int
    ) -> LeasedThread | None:
        with self._tracer.start_as_current_span("statestore.lease", attributes={"statestore.lease.by": "response"}):
            return await super().take_thread(
                owner=owner, thread_id=thread_id, head=head, token=token, now_ms=now_ms, until_ms=until_ms
            )

    async def take_session(
        self, *, owner: str, session: str, token: str, now_ms: int, until_ms: int
    ) -> LeasedThread | None:
        with self._tracer.start_as_current_span("statestore.lease", attributes={"statestore.lease.by": "session"}):
            return await super().take_session(
                owner=owner, session=session, token=token, now_ms=now_ms, until_ms=until_ms
            )

    async def commit_thread_turn(self, commit: TurnCommit) -> HeadAfter | bool:
        usage = {
            "gen_ai.usage.input_tokens": commit.usage.input_tokens,
            "gen_ai.usage.output_tokens": commit.usage.output_tokens,
        }
        request = trace.get_current_span()
        request.set_attributes(usage)
        if commit.model is not None:
            request.set_attribute("gen_ai.request.model", commit.model)
        if commit.max_tokens is not None:
            request.set_attribute("gen_ai.request.max_tokens", commit.max_tokens)
        request.set_attribute("gen_ai.response.id", commit.head_message_id)
        with self._tracer.start_as_current_span(
            "statestore.commit", attributes={**usage, "statestore.thread.messages_added": len(commit.rows)}
        ) as span:
            committed = await super().commit_thread_turn(commit)
            span.set_attribute("statestore.commit.stored", committed is not False)
            return committed


class TracedRepository(ThreadStore):
    """Every method of the store the threaded turn calls, written out (no delegation by attribute lookup), so mypy
    checks each against ThreadStore: a create's lease and the history read from the database get spans."""

    __slots__ = ("_inner", "_tracer")

    def __init__(self, inner: ThreadStore, tracer: Tracer) -> None:
        self._inner = inner
        self._tracer = tracer

    async def begin_create(
        self, thread: NewThread, *, token: str, now_ms: int, lease_until_ms: int, bind_session: bool = True
    ) -> bool:
        with self._tracer.start_as_current_span("statestore.lease", attributes={"statestore.lease.by": "create"}):
            return await self._inner.begin_create(
                thread, token=token, now_ms=now_ms, lease_until_ms=lease_until_ms, bind_session=bind_session
            )

    async def load_context(self, thread_id: str, *, owner: str) -> list[tuple[int, bytes]]:
        with self._tracer.start_as_current_span(
            "statestore.history_read", attributes={"statestore.history.source": "database"}
        ) as span:
            rows = await self._inner.load_context(thread_id, owner=owner)
            span.set_attribute("statestore.history.messages", len(rows))
            return rows

    # Untraced: small statements off the common path, or inside a span already.

    async def why_not_continuable(
        self, *, owner: str, thread_id: str, response_id: str, now_ms: int
    ) -> ContinueRefusal:
        return await self._inner.why_not_continuable(
            owner=owner, thread_id=thread_id, response_id=response_id, now_ms=now_ms
        )

    async def backend_id_of(self, *, owner: str, thread_id: str, response_id: str, now_ms: int) -> str | None:
        return await self._inner.backend_id_of(owner=owner, thread_id=thread_id, response_id=response_id, now_ms=now_ms)

    async def session_is_busy(self, *, owner: str, session: str, now_ms: int) -> bool:
        return await self._inner.session_is_busy(owner=owner, session=session, now_ms=now_ms)

    async def read_by_response(
        self, *, owner: str, thread_id: str, response_id: str, now_ms: int
    ) -> LeasedThread | None:
        return await self._inner.read_by_response(
            owner=owner, thread_id=thread_id, response_id=response_id, now_ms=now_ms
        )

    async def read_by_session(self, *, owner: str, session: str, now_ms: int) -> LeasedThread | None:
        return await self._inner.read_by_session(owner=owner, session=session, now_ms=now_ms)

    async def abandon_create(self, *, thread_id: str, token: str) -> None:
        await self._inner.abandon_create(thread_id=thread_id, token=token)

    async def is_stored(self, *, thread_id: str, response_id: str) -> bool:
        return await self._inner.is_stored(thread_id=thread_id, response_id=response_id)


class TracedCache(HistoryCache):
    """The history cache with its read in a span; every other method of HistoryCache written out, as above."""

    __slots__ = ("_inner", "_tracer")

    def __init__(self, inner: HistoryCache, tracer: Tracer) -> None:
        self._inner = inner
        self._tracer = tracer

    async def get(self, key: CacheKey) -> CachedHistory | None:
        with self._tracer.start_as_current_span(
            "statestore.history_read", attributes={"statestore.history.source": "cache"}
        ) as span:
            cached = await self._inner.get(key)
            span.set_attribute("statestore.cache.hit", cached is not None)
            return cached

    @property
    def errors(self) -> int:
        return self._inner.errors

    @property
    def kind(self) -> str:
        return self._inner.kind

    async def put(
        self, key: CacheKey, history: CachedHistory, ttl_ms: int, *, sealer: ContentSealer, then: Settle | None = None
    ) -> None:
        await self._inner.put(key, history, ttl_ms, sealer=sealer, then=then)

    async def append(
        self,
        key: CacheKey,
        expected_count: int,
        added: list[bytes],
        ttl_ms: int,
        *,
        sealer: ContentSealer,
        new_count: int | None = None,
        then: Settle | None = None,
    ) -> None:
        await self._inner.append(key, expected_count, added, ttl_ms, sealer=sealer, new_count=new_count, then=then)

    async def move(
        self,
        old: CacheKey,
        new: CacheKey,
        expected_count: int,
        added: list[bytes],
        ttl_ms: int,
        *,
        sealer: ContentSealer,
        then: Settle | None = None,
    ) -> bool:
        return await self._inner.move(old, new, expected_count, added, ttl_ms, sealer=sealer, then=then)

    async def delete(self, key: CacheKey) -> bool:
        return await self._inner.delete(key)

    async def delete_many(self, keys: Sequence[CacheKey]) -> bool:
        return await self._inner.delete_many(keys)

    async def ping(self) -> bool:
        return await self._inner.ping()

    async def aclose(self) -> None:
        await self._inner.aclose()


class TracedUpstream(Upstream):
    """`system`: the GenAI system the backend speaks for (anthropic for Messages, openai for Chat Completions)."""

    __slots__ = ("_inner", "_system", "_tracer")

    def __init__(self, inner: Upstream, tracer: Tracer, *, system: str = GENAI_SYSTEM) -> None:
        self._inner = inner
        self._tracer = tracer
        self._system = system

    @property
    def base_url(self) -> str:
        return self._inner.base_url

    async def send(
        self, method: str, path_and_query: str, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> UpstreamResponse:
        attributes: dict[str, AttributeValue] = {
            "http.request.method": method,
            "url.path": path_and_query.split("?", 1)[0],
            "server.address": urlsplit(self._inner.base_url).hostname or "",
            "gen_ai.system": self._system,
            "gen_ai.operation.name": "chat",
        }
        found = _MODEL.search(body, 0, _MODEL_SCAN_BYTES)
        if found is not None:
            attributes["gen_ai.request.model"] = found.group(1).decode("utf-8", "replace")
        with self._tracer.start_as_current_span(
            "statestore.upstream", kind=SpanKind.CLIENT, attributes=attributes
        ) as span:
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
            outgoing = [(n, v) for n, v in headers if n not in (b"traceparent", b"tracestate")]
            outgoing += [(name.encode("latin-1"), value.encode("latin-1")) for name, value in carrier.items()]
            response = await self._inner.send(method, path_and_query, outgoing, body)
            span.set_attribute("http.response.status_code", response.status)
            return response

    async def aclose(self) -> None:
        await self._inner.aclose()


class TracedHttp:
    """An HTTP app inside a SERVER span that continues the client's trace context. `route`: the hot route's
    template; for the FastAPI app it is read from the scope once its router has matched."""

    def __init__(self, app: ASGIApp, tracer: Tracer, *, route: str | None = None) -> None:
        self.app = app
        self.tracer = tracer
        self.route = route

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        carrier = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
        method = scope["method"]
        status: list[int] = []

        async def send_noting_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        attributes: dict[str, AttributeValue] = {"http.request.method": method}
        if self.route is not None:
            attributes.update(
                {"http.route": self.route, "gen_ai.system": GENAI_SYSTEM, "gen_ai.operation.name": "chat"}
            )
        with self.tracer.start_as_current_span(
            f"{method} {self.route}" if self.route else method,
            context=propagate.extract(carrier),
            kind=SpanKind.SERVER,
            attributes=attributes,
        ) as span:
            try:
                await self.app(scope, receive, send_noting_status)
            finally:
                route = self.route or getattr(scope.get("route"), "path_format", None)
                if self.route is None and isinstance(route, str):
                    span.update_name(f"{method} {route}")
                    span.set_attribute("http.route", route)
                if status:
                    span.set_attribute("http.response.status_code", status[0])
                    if status[0] >= 500:
                        span.set_status(Status(StatusCode.ERROR))
