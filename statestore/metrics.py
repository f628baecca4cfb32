"""Prometheus metrics, in a registry owned by the app (not the global one, so a test can build many apps).

Every label has a small fixed set of values: `route` is a route template or "other", `method` one of
the standard methods or "other", `status` a status code, and the rest are the Literal types below.
Nothing about a request's content is ever a label.

The series are prometheus_client's own metrics, in one process and across workers alike; each
series' child is resolved once (`_Series`), since `labels()` validates its values on every call.

Several worker processes (`uvicorn --workers N`): set `PROMETHEUS_MULTIPROC_DIR` to an empty directory,
writable by the server, in the environment of the process that starts the workers (prometheus_client
reads it at import time, so it must be set before the server starts, not from the app). Each worker
then writes its samples to files there through prometheus_client's own metrics, and `render()` merges
the files of all workers, whichever worker serves `/metrics`. Empty the directory before each start, or
counters carry over from the last run. There are no other gauges here, so nothing needs cleaning up when a
worker exits, save two: `websocket_connections` and `websocket_held_bytes` add up the live workers' files
(`livesum`). A worker that stops closes its connections first, so its files hold 0; one that was killed cannot, and
each scrape drops the live gauges' files of processes that are gone (prometheus_client's `mark_process_dead`, which a
supervisor would call: uvicorn's has no hook for it), so the connections of a killed worker are not counted on.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

ThreadTurnKind = Literal["create", "continue"]
ThreadTurnOutcome = Literal["stored", "not_stored", "rejected"]
# A Responses turn starts a chain, continues one (previous_response_id), or is made on a conversation.
ResponseTurnKind = Literal["create", "continue", "conversation"]
BackgroundOutcome = Literal["completed", "incomplete", "failed", "cancelled", "rerun"]
_BACKGROUND_OUTCOMES: tuple[BackgroundOutcome, ...] = ("completed", "incomplete", "failed", "cancelled", "rerun")
CacheLookupResult = Literal["hit", "miss", "stale", "error"]
# How a threaded continue held its thread's head (store/thread_claims.py).
HeadHeld = Literal["claim", "claim_and_lease", "lease"]
_HEADS_HELD: tuple[HeadHeld, ...] = ("claim", "claim_and_lease", "lease")
ParentRead = Literal["cache", "database"]
_PARENT_READS: tuple[ParentRead, ...] = ("cache", "database")
UpstreamErrorKind = Literal["unreachable", "timeout"]
# Time to the backend's response headers, by what came back: a 2xx/3xx, a 4xx, a 5xx, or no headers at all.
UpstreamOutcome = Literal["ok", "client_error", "server_error", "unreachable", "timeout"]

OTHER = "other"
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

# 1 ms to 60 s: a cache hit is a few ms, a long non-streaming completion tens of seconds.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_THREAD_TURN_KINDS: tuple[ThreadTurnKind, ...] = ("create", "continue")
_THREAD_TURN_OUTCOMES: tuple[ThreadTurnOutcome, ...] = ("stored", "not_stored", "rejected")
_RESPONSE_TURN_KINDS: tuple[ResponseTurnKind, ...] = ("create", "continue", "conversation")
_CACHE_RESULTS: tuple[CacheLookupResult, ...] = ("hit", "miss", "stale", "error")
_UPSTREAM_ERROR_KINDS: tuple[UpstreamErrorKind, ...] = ("unreachable", "timeout")


@dataclass(frozen=True, slots=True)
class Declared:
    name: str
    help: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] = ()  # a histogram's upper bounds, without +Inf
    gauge: bool = False


M = TypeVar("M", Counter, Histogram, Gauge)


class _Series(Generic[M]):
    """A metric's children, each resolved once by its label values (in the declared order)."""

    __slots__ = ("_children", "_metric")

    def __init__(self, metric: M) -> None:
        self._metric: M = metric
        self._children: dict[tuple[str, ...], M] = {}

    def labels(self, *values: str) -> M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child


HTTP_REQUESTS = Declared(
    "http_requests", "HTTP requests served, by route template, method and status.", ("route", "method", "status")
)
HTTP_REQUEST_DURATION = Declared(
    "http_request_duration_seconds",
    "Time from the request's arrival to the last byte of its response.",
    ("route", "method"),
    DURATION_BUCKETS,
)
UPSTREAM_REQUEST_DURATION = Declared(
    "upstream_request_duration_seconds",
    "Time from sending a request to the backend to its response headers (or the failure).",
    ("route", "outcome"),
    DURATION_BUCKETS,
)
UPSTREAM_ERRORS = Declared(
    "upstream_errors", "Backend requests that got no response: unreachable or timed out.", ("kind",)
)
TURNS = Declared(
    "turns",
    "Turns asking to be stored, by front door (messages: threads and sessions; responses: responses and "
    "conversations), kind, and whether the turn was stored, returned but not stored, or rejected.",
    ("door", "kind", "outcome"),
)
# Deprecated, to be removed in the next release: turns_total{door="messages"} counts the same.
THREAD_TURNS = Declared(
    "thread_turns",
    'Deprecated: turns_total{door="messages"}. Threaded turns by kind, and whether the turn was stored, '
    "returned but not stored, or rejected.",
    ("kind", "outcome"),
)
BACKGROUND_TURNS = Declared(
    "background_turns",
    "Background responses by how they ended on this replica: completed, incomplete, failed, cancelled, or "
    "rerun (claimed from a replica that stopped before its run had published anything).",
    ("outcome",),
)
CACHE_LOOKUPS = Declared("cache_lookups", "Thread cache lookups by result.", ("result",))
THREAD_HEADS = Declared(
    "thread_heads",
    "Threaded continues by how they held the thread's head: claimed in Redis, claimed and leased in the database (the "
    "row was not served from Redis), or leased alone (claims off, Redis away, a session).",
    ("held",),
)
RESPONSE_PARENTS = Declared(
    "response_parents",
    "Responses continues by where the previous response's row was read: from Redis, beside the chain's cached "
    "context, or from the database.",
    ("read",),
)
WEBSOCKET_CONNECTIONS = Declared(
    "websocket_connections",
    "WebSocket connections open, by route (WebSocket mode on /v1/responses).",
    ("route",),
    gauge=True,
)
WEBSOCKET_RESPONSES = Declared(
    "websocket_responses",
    "response.create events answered on a WebSocket, by the status the same request would have had over HTTP (an "
    "error event's `status`; 499 when the client left first).",
    ("status",),
)
WEBSOCKET_HELD_BYTES = Declared(
    "websocket_held_bytes",
    "Bytes of chain context WebSocket connections hold, together, so that a continue from the head a connection made "
    "last reads none from Redis (bounded by STATESTORE_SOCKET_HELD_BYTES), by route; updated in 64 KiB steps.",
    ("route",),
    gauge=True,
)
DECLARED = (
    HTTP_REQUESTS,
    HTTP_REQUEST_DURATION,
    UPSTREAM_REQUEST_DURATION,
    UPSTREAM_ERRORS,
    TURNS,
    THREAD_TURNS,
    BACKGROUND_TURNS,
    CACHE_LOOKUPS,
    THREAD_HEADS,
    RESPONSE_PARENTS,
    WEBSOCKET_CONNECTIONS,
    WEBSOCKET_RESPONSES,
    WEBSOCKET_HELD_BYTES,
)


def method_label(method: str) -> str:
    # A client can send any token as a method; only the standard ones become label values.
    return method if method in _METHODS else OTHER


def upstream_outcome(status: int) -> UpstreamOutcome:
    if status >= 500:
        return "server_error"
    if status >= 400:
        return "client_error"
    return "ok"


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # With it set (before prometheus_client was imported), each metric's values live in that directory's files.
        self.multiprocess_dir = os.environ.get(MULTIPROC_DIR_ENV) or None
        self._requests = self._counter(HTTP_REQUESTS)
        self._request_durations = self._histogram(HTTP_REQUEST_DURATION)
        self._upstream_durations = self._histogram(UPSTREAM_REQUEST_DURATION)
        self._upstream_errors = self._counter(UPSTREAM_ERRORS)
        self._turns = self._counter(TURNS)
        self._thread_turns = self._counter(THREAD_TURNS)
        self._background_turns = self._counter(BACKGROUND_TURNS)
        self._cache_lookups = self._counter(CACHE_LOOKUPS)
        self._thread_heads = self._counter(THREAD_HEADS)
        self._response_parents = self._counter(RESPONSE_PARENTS)
        self._websocket_connections = self._gauge(WEBSOCKET_CONNECTIONS)
        self._websocket_responses = self._counter(WEBSOCKET_RESPONSES)
        self._websocket_held_bytes = self._gauge(WEBSOCKET_HELD_BYTES)
        self._initialise_fixed_series()

    def _gauge(self, declared: Declared) -> _Series[Gauge]:
        # Across workers, the live workers' values added up (a worker that stops has closed its connections).
        metric = Gauge(
            declared.name, declared.help, declared.labels, registry=self.registry, multiprocess_mode="livesum"
        )
        return _Series(metric)

    def _counter(self, declared: Declared) -> _Series[Counter]:
        return _Series(Counter(declared.name, declared.help, declared.labels, registry=self.registry))

    def _histogram(self, declared: Declared) -> _Series[Histogram]:
        metric = Histogram(
            declared.name, declared.help, declared.labels, buckets=declared.buckets, registry=self.registry
        )
        return _Series(metric)

    def _initialise_fixed_series(self) -> None:
        # Series with fixed label sets exist from the start at 0, so rate() and alerts see the first event.
        for outcome in _THREAD_TURN_OUTCOMES:
            for kind in _THREAD_TURN_KINDS:
                self._thread_turns.labels(kind, outcome)
                self._turns.labels("messages", kind, outcome)
            for response_kind in _RESPONSE_TURN_KINDS:
                self._turns.labels("responses", response_kind, outcome)
        for result in _CACHE_RESULTS:
            self._cache_lookups.labels(result)
        for held in _HEADS_HELD:
            self._thread_heads.labels(held)
        for read in _PARENT_READS:
            self._response_parents.labels(read)
        for background in _BACKGROUND_OUTCOMES:
            self._background_turns.labels(background)
        for error_kind in _UPSTREAM_ERROR_KINDS:
            self._upstream_errors.labels(error_kind)

    def observe_request(self, route: str, method: str, status: int, seconds: float) -> None:
        method = method_label(method)
        self._requests.labels(route, method, str(status)).inc()
        self._request_durations.labels(route, method).observe(seconds)

    def observe_upstream(self, route: str, outcome: UpstreamOutcome, seconds: float) -> None:
        self._upstream_durations.labels(route, outcome).observe(seconds)

    def count_upstream_error(self, kind: UpstreamErrorKind) -> None:
        self._upstream_errors.labels(kind).inc()

    def count_thread_turn(self, kind: ThreadTurnKind, outcome: ThreadTurnOutcome) -> None:
        self._turns.labels("messages", kind, outcome).inc()
        self._thread_turns.labels(kind, outcome).inc()

    def count_response_turn(self, kind: ResponseTurnKind, outcome: ThreadTurnOutcome) -> None:
        self._turns.labels("responses", kind, outcome).inc()

    def count_background_turn(self, outcome: BackgroundOutcome) -> None:
        self._background_turns.labels(outcome).inc()

    def count_cache_lookup(self, result: CacheLookupResult) -> None:
        self._cache_lookups.labels(result).inc()

    def count_thread_head(self, held: HeadHeld) -> None:
        self._thread_heads.labels(held).inc()

    def count_response_parent(self, read: ParentRead) -> None:
        self._response_parents.labels(read).inc()

    def declare_websocket_route(self, route: str) -> None:
        """The open connections' series of a route that takes WebSockets, at 0 from the start."""
        self._websocket_connections.labels(route)
        self._websocket_held_bytes.labels(route)

    def websocket_opened(self, route: str) -> None:
        self._websocket_connections.labels(route).inc()

    def websocket_closed(self, route: str) -> None:
        self._websocket_connections.labels(route).dec()

    def websocket_held_bytes(self, route: str) -> Callable[[float], None]:
        """What sets the route's `websocket_held_bytes` (it changes every socket turn: resolved once, by its caller)."""
        return self._websocket_held_bytes.labels(route).set

    def count_websocket_response(self, status: int) -> None:
        self._websocket_responses.labels(str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        """The `/metrics` body and its content type (the classic text format, which every Prometheus reads)."""
        if self.multiprocess_dir is None:
            return generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4
        _forget_the_dead(self.multiprocess_dir)
        # A fresh registry per scrape: the collector reads every worker's files at collect time.
        merged = CollectorRegistry()
        MultiProcessCollector(merged, path=self.multiprocess_dir)  # type: ignore[no-untyped-call]
        return generate_latest(merged), CONTENT_TYPE_PLAIN_0_0_4


_LIVE_GAUGE_FILE = re.compile(r"gauge_live[a-z]+_(\d+)\.db")


def _forget_the_dead(directory: str) -> None:
    """Drop the live gauges' files of the processes in `directory` that are gone (killed workers)."""
    pids = {int(found.group(1)) for name in os.listdir(directory) if (found := _LIVE_GAUGE_FILE.fullmatch(name))}
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            mark_process_dead(pid, directory)  # type: ignore[no-untyped-call]
        except PermissionError:
            pass  # alive, another user's
