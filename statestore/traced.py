"""The traced variants of the serving objects, used only when tracing is on (statestore/tracing.py).

A span per `POST /v1/messages` (SERVER, continuing the client's traceparent), with children for the lease
(`statestore.lease`), the history read (`statestore.history_read`: the cache, and the database on a miss), the
backend call (`statestore.upstream`, CLIENT, which carries traceparent to the backend) and the commit
(`statestore.commit`). GenAI semantic-convention attributes: gen_ai.system, gen_ai.operation.name,
gen_ai.request.model, gen_ai.request.max_tokens, gen_ai.usage.input_tokens / output_tokens. Never message content.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from statestore.store.turn_records import TurnCommit

GENAI_SYSTEM = "anthropic"
# The rebuilt request puts the turn's fields first (threads/assembly.py), so the model is within the first bytes.
_MODEL = re.compile(rb'"model"\s*:\s*"([^"\\]{1,256})"')
_MODEL_SCAN_BYTES = 4096


class _Delegate:
    """Forwards every attribute it does not override to the wrapped object."""

    def __init__(self, inner: Any, tracer: Tracer) -> None:
        self._inner = inner
        self._tracer = tracer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class TracedRepository(_Delegate):
    async def acquire_by_response(self, **kwargs: Any) -> Any:
        with self._tracer.start_as_current_span("statestore.lease", attributes={"statestore.lease.by": "response"}):
            return await self._inner.acquire_by_response(**kwargs)

    async def acquire_by_session(self, **kwargs: Any) -> Any:
        with self._tracer.start_as_current_span("statestore.lease", attributes={"statestore.lease.by": "session"}):
            return await self._inner.acquire_by_session(**kwargs)

    async def begin_create(self, *args: Any, **kwargs: Any) -> Any:
        with self._tracer.start_as_current_span("statestore.lease", attributes={"statestore.lease.by": "create"}):
            return await self._inner.begin_create(*args, **kwargs)

    async def load_history(self, thread_id: str) -> Any:
        with self._tracer.start_as_current_span(
            "statestore.history_read", attributes={"statestore.history.source": "database"}
        ) as span:
            rows = await self._inner.load_history(thread_id)
            span.set_attribute("statestore.history.messages", len(rows))
            return rows

    async def commit_turn(self, commit: TurnCommit) -> Any:
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
            committed = await self._inner.commit_turn(commit)
            span.set_attribute("statestore.commit.stored", bool(committed))
            return committed


class TracedCache(_Delegate):
    async def get(self, thread_id: str) -> Any:
        with self._tracer.start_as_current_span(
            "statestore.history_read", attributes={"statestore.history.source": "cache"}
        ) as span:
            cached = await self._inner.get(thread_id)
            span.set_attribute("statestore.cache.hit", cached is not None)
            return cached


class TracedUpstream(_Delegate):
    """`system`: the GenAI system the backend speaks for (anthropic for Messages, openai for Chat Completions)."""

    def __init__(self, inner: Any, tracer: Tracer, *, system: str = GENAI_SYSTEM) -> None:
        super().__init__(inner, tracer)
        self._system = system

    async def send(self, method: str, path_and_query: str, headers: list[tuple[bytes, bytes]], body: bytes) -> Any:
        attributes: dict[str, Any] = {
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

        attributes: dict[str, Any] = {"http.request.method": method}
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
