"""OpenTelemetry traces (statestore/tracing.py, statestore/traced.py), with the SDK's in-memory exporter: a span per
request, children for the lease, the history read, the upstream call and the commit, GenAI attributes, the client's
trace continued and traceparent carried to the backend. Off by default, and then the plain objects serve.

The app runs in this process on PostgreSQL and Redis (so the exporter can be read), in front of the fake backend,
which records the headers it received."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx2
import openai
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from statestore.api.front_door import FrontDoor
from statestore.app import create_server_app
from statestore.config import Settings
from statestore.tracing import provider_from_environment, tracing_requested
from tests.support.fake_backend import FakeBackend
from tests.support.redis_keys import drop_prefix

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = "00f067aa0ba902b7"


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    # One per app: the app shuts its provider down on exit, and the exporter with it.
    return InMemorySpanExporter()


@dataclass(frozen=True)
class Clients:
    anthropic: anthropic.AsyncAnthropic
    openai: openai.AsyncOpenAI


@pytest.fixture
async def traced_clients(
    migrated_pg_url: str, redis_url: str, redis_prefix: str, backend: FakeBackend, exporter: InMemorySpanExporter
) -> AsyncIterator[Clients]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    front = create_server_app(
        Settings(
            database_url=migrated_pg_url,
            redis_url=redis_url,
            redis_prefix=redis_prefix,
            upstream_url=backend.url,
            chat_upstream_url=backend.url,
            owner_secret="tracing-secret-0123456789",
        ),
        tracer_provider=provider,
    )
    assert isinstance(front, FrontDoor)
    async with (
        front.app.router.lifespan_context(front.app),
        # The SDKs' own HTTP library (httpx2), in process.
        httpx2.AsyncClient(transport=httpx2.ASGITransport(app=front), base_url="http://statestore") as http,
    ):
        exporter.clear()
        yield Clients(
            anthropic.AsyncAnthropic(base_url="http://statestore", api_key="sk-trace", http_client=http),
            openai.AsyncOpenAI(base_url="http://statestore/v1", api_key="sk-trace", http_client=http),
        )


@pytest.fixture
def traced_client(traced_clients: Clients) -> anthropic.AsyncAnthropic:
    return traced_clients.anthropic


def _request_spans(spans: tuple[ReadableSpan, ...]) -> list[ReadableSpan]:
    return [s for s in spans if s.name == "POST /v1/messages"]


def _children(spans: tuple[ReadableSpan, ...], parent: ReadableSpan) -> dict[str, list[ReadableSpan]]:
    found: dict[str, list[ReadableSpan]] = {}
    for span in spans:
        if span.parent is not None and parent.context is not None and span.parent.span_id == parent.context.span_id:
            found.setdefault(span.name, []).append(span)
    return found


async def test_a_threaded_conversation_is_traced(
    traced_client: anthropic.AsyncAnthropic, exporter: InMemorySpanExporter, backend: FakeBackend
) -> None:
    thread = traced_client.beta.messages.thread(model="claude-trace", max_tokens=77)
    await thread.send({"role": "user", "content": "one"})
    await thread.send(
        {"role": "user", "content": "two"}, extra_headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"}
    )
    async with thread.stream({"role": "user", "content": "three"}) as stream:
        await stream.get_final_message()

    spans = exporter.get_finished_spans()
    create, continued, streamed = _request_spans(spans)
    for request in (create, continued, streamed):
        attributes: Any = request.attributes
        assert request.kind == SpanKind.SERVER
        assert attributes["http.response.status_code"] == 200
        assert attributes["gen_ai.system"] == "anthropic"
        assert attributes["gen_ai.request.model"] == "claude-trace"
        assert attributes["gen_ai.request.max_tokens"] == 77
        assert attributes["gen_ai.usage.input_tokens"] > 0 and attributes["gen_ai.usage.output_tokens"] > 0
        assert attributes["gen_ai.response.id"].startswith("msg_")
        children = _children(spans, request)
        assert {"statestore.lease", "statestore.upstream", "statestore.commit"} <= set(children)
        upstream: Any = children["statestore.upstream"][0]
        assert upstream.kind == SpanKind.CLIENT
        assert upstream.attributes["gen_ai.request.model"] == "claude-trace"
    # A continue reads the history (the cache, on this set-up); a create has none to read.
    assert "statestore.history_read" not in _children(spans, create)
    history: Any = _children(spans, continued)["statestore.history_read"][0]
    assert history.attributes["statestore.history.source"] == "cache"
    # The client's trace context is continued.
    assert continued.context is not None and f"{continued.context.trace_id:032x}" == CLIENT_TRACE
    assert continued.parent is not None and f"{continued.parent.span_id:016x}" == CLIENT_PARENT

    # The backend got traceparent naming the upstream span of each request.
    sent = [(r.header("traceparent") or "").split("-")[:3] for r in backend.requests()]
    upstream_spans = [_children(spans, r)["statestore.upstream"][0] for r in (create, continued, streamed)]
    expected = [["00", f"{s.context.trace_id:032x}", f"{s.context.span_id:016x}"] for s in upstream_spans if s.context]
    assert sent == expected


def _only(children: dict[str, list[ReadableSpan]], name: str) -> dict[str, Any]:
    """The attributes of the one child span named `name`."""
    (span,) = children.get(name, [])
    return dict(span.attributes or {})


async def test_each_span_of_a_threaded_turn(
    traced_client: anthropic.AsyncAnthropic, exporter: InMemorySpanExporter, redis_url: str, redis_prefix: str
) -> None:
    """Span by span: a create, a continue served from the cache, and a continue after the cache lost the thread,
    whose history is read from the database (its own span, beside the cache's miss)."""
    thread = traced_client.beta.messages.thread(model="claude-trace", max_tokens=20)
    await thread.send({"role": "user", "content": "one"})
    await thread.send({"role": "user", "content": "two"})
    await asyncio.to_thread(drop_prefix, redis_url, redis_prefix)
    await thread.send({"role": "user", "content": "three"})

    spans = exporter.get_finished_spans()
    create, hit, miss = (_children(spans, request) for request in _request_spans(spans))
    # A continue claims its head in Redis (store/thread_claims.py); one whose entry Redis lost leases it in the
    # database as well.
    for children, by in ((create, ["create"]), (hit, ["claim"]), (miss, ["claim", "response"])):
        leases = sorted(children.get("statestore.lease", []), key=lambda span: span.start_time or 0)
        assert [dict(span.attributes or {}) for span in leases] == [{"statestore.lease.by": b} for b in by]
        upstream = _only(children, "statestore.upstream")
        assert (upstream["url.path"], upstream["http.response.status_code"]) == ("/v1/messages", 200)
        commit = _only(children, "statestore.commit")
        assert (commit["statestore.commit.stored"], commit["statestore.thread.messages_added"]) == (True, 2)
        assert commit["gen_ai.usage.input_tokens"] > 0 and commit["gen_ai.usage.output_tokens"] > 0
    assert "statestore.history_read" not in create
    (cached,) = hit["statestore.history_read"]
    assert cached.attributes == {"statestore.history.source": "cache", "statestore.cache.hit": True}
    reads = {
        str((span.attributes or {})["statestore.history.source"]): span for span in miss["statestore.history_read"]
    }
    assert set(reads) == {"cache", "database"}
    assert reads["cache"].attributes == {"statestore.history.source": "cache", "statestore.cache.hit": False}
    # The four messages stored before the third turn: one, its reply, two, its reply.
    assert reads["database"].attributes == {"statestore.history.source": "database", "statestore.history.messages": 4}


async def test_other_routes_get_a_span_named_for_their_route(
    traced_client: anthropic.AsyncAnthropic, exporter: InMemorySpanExporter
) -> None:
    thread = traced_client.beta.messages.thread(model="claude-trace", max_tokens=10)
    await thread.send({"role": "user", "content": "hi"})
    exporter.clear()
    await traced_client.get("/statestore/v1/threads", cast_to=object)
    (span,) = exporter.get_finished_spans()
    assert span.name == "GET /statestore/v1/threads"
    assert span.attributes is not None and span.attributes["http.response.status_code"] == 200


async def test_a_responses_turn_is_traced_as_openai(traced_clients: Clients, exporter: InMemorySpanExporter) -> None:
    """The Responses front door's backend speaks Chat Completions: its upstream span says so."""
    first = await traced_clients.openai.responses.create(model="gpt-trace", input="one")
    await traced_clients.openai.responses.create(model="gpt-trace", input="two", previous_response_id=first.id)
    spans = exporter.get_finished_spans()
    requests = [s for s in spans if s.name == "POST /v1/responses"]
    assert len(requests) == 2
    for request in requests:
        (upstream,) = _children(spans, request)["statestore.upstream"]
        attributes: Any = upstream.attributes
        assert upstream.kind == SpanKind.CLIENT
        assert attributes["gen_ai.system"] == "openai"
        assert attributes["gen_ai.request.model"] == "gpt-trace"
        assert attributes["url.path"] == "/v1/chat/completions"


def test_tracing_is_off_unless_otel_variables_ask() -> None:
    assert not tracing_requested({})
    assert not tracing_requested({"OTEL_SERVICE_NAME": "x"})
    assert not tracing_requested({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"})
    assert not tracing_requested({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"})
    assert tracing_requested({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert tracing_requested({"OTEL_TRACES_EXPORTER": "console"})
    provider = provider_from_environment({"OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "ss-test"})
    assert provider is not None and provider.resource.attributes["service.name"] == "ss-test"
    provider.shutdown()
    with pytest.raises(RuntimeError, match="http/protobuf"):
        provider_from_environment({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    with pytest.raises(RuntimeError, match="unsupported zipkin"):
        provider_from_environment({"OTEL_TRACES_EXPORTER": "zipkin"})


def test_off_means_the_plain_objects_serve(tmp_path: Any) -> None:
    # The server app as `statestore serve` builds it, with no OTEL_* variable: the hot route runs through the plain
    # middleware, and statestore's traced wrappers are not even loaded. (Libraries may import OpenTelemetry's API
    # themselves when it is installed: FastAPI and redis-py do.)
    probe = (
        "import sys\n"
        "from statestore.app import create_server_app\n"
        "from statestore.config import Settings\n"
        "from statestore.api.front_door import FrontDoor\n"
        "from statestore.middleware import RequestContextMiddleware\n"
        f"front = create_server_app(Settings(database_url='sqlite:///{tmp_path}/x.db', owner_secret='s' * 20))\n"
        "assert set(front._hot) == {'/v1/messages', '/v1/responses'}, front._hot\n"
        "assert all(type(hot) is RequestContextMiddleware for hot in front._hot.values()), front._hot\n"
        "assert front._rest is front.app\n"
        "assert 'statestore.traced' not in sys.modules\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("OTEL_")}
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


@pytest.fixture
def backend(fake_backend_process: FakeBackend) -> Iterator[FakeBackend]:
    fake_backend_process.reset()
    yield fake_backend_process
