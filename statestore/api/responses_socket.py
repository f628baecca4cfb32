"""WebSocket mode on `/v1/responses` (docs/responses.md, "WebSocket mode"), as the `openai` SDK's
`client.responses.connect()` speaks it: the credential checked once on the handshake (a refused one gets the API's
status and error body), then JSON events. `response.create` runs the turn of `POST /v1/responses` with
`stream: true` (api/openai_responses.py `begin_turn`, responses/turn_events.py), its events sent as messages;
responses run one after another. `response.steer` queues user input for the running response's continuation
(responses/steering.py). A `store: false` response lives in this connection's memory only (responses/kept.py)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import orjson
from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from statestore import socket_protocol
from statestore.api.openai_responses import begin_turn, end_turn, turns_of
from statestore.auth import Principal
from statestore.errors import ServiceUnavailable, StatestoreError, StreamBrokenOff
from statestore.logs import new_request_id, request_id_var
from statestore.metrics import Metrics
from statestore.middleware import CLIENT_CLOSED_REQUEST, access_logger
from statestore.resources import Resources
from statestore.responses import steering
from statestore.responses.errors import BackendError, BadRequest, RateLimited, as_openai
from statestore.responses.items import join_segments
from statestore.responses.kept import KeptResponse, keep
from statestore.responses.request import TurnRequest, turn_of_event
from statestore.responses.steering import Steer, SteerRefused, SteerTarget
from statestore.responses.stream import SocketEvents
from statestore.responses.turn_events import turn_events
from statestore.store.engine import DATABASE_ERRORS, UNSTORABLE_VALUE_ERRORS
from statestore.store.response_records import ResponseRow

log = logging.getLogger("statestore.responses_socket")

PATH = "/v1/responses"
GOING_AWAY = 1001
MESSAGE_TOO_BIG = 1009
INTERNAL_ERROR = 1011
# response.create events waiting behind the running response on one connection; one more gets an `error` event (429),
# so that a client cannot queue events (each up to a body's size) without end.
QUEUED_AT_MOST = 16
_FINISHED_REMEMBERED = 256  # responses this connection finished, told apart from unknown ones when steered late
Headers = list[tuple[bytes, bytes]]
# What ends one response with an `error` event, the connection still usable.
_TURN_FAULTS: tuple[type[BaseException], ...] = (
    StatestoreError,
    StreamBrokenOff,
    *DATABASE_ERRORS,
    *UNSTORABLE_VALUE_ERRORS,
)
Job = tuple[dict[str, Any], list[Steer]]  # a response.create event, and the steering input its `input` carries


class ResponsesSocket:
    """The ASGI app of a WebSocket on /v1/responses."""

    def __init__(
        self,
        app: FastAPI,
        *,
        metrics: Metrics,
        max_message_bytes: int,
        max_seconds: float,
        grace_seconds: float,
        held_bytes: int = 256 * 1024 * 1024,
    ) -> None:
        self.app = app
        self.metrics = metrics
        metrics.declare_websocket_route(PATH)
        self.held = HeldContexts(held_bytes, metrics)
        self.max_message_bytes = max_message_bytes
        self.max_seconds = max_seconds
        self.grace_seconds = grace_seconds
        self.open: set[Connection] = set()
        self._draining: asyncio.Future[None] | None = None
        socket_protocol.DRAINS.append(self.drain)

    def drain(self) -> bool:
        """Shutdown (statestore/socket_protocol.py): close every connection once its running response is done."""
        if self._draining is None:
            self._draining = asyncio.ensure_future(self.aclose(self.grace_seconds))
        return True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        resources: Resources = self.app.state.resources
        headers: Headers = scope["headers"]
        started = time.perf_counter()
        try:
            principal = await resources.authenticator.authenticate(headers)
            turns_of(resources)
        except StatestoreError as exc:
            await _refuse(scope, send, exc, started)
            return
        except DATABASE_ERRORS:
            error = ServiceUnavailable("the response store is unavailable; try again shortly")
            await _refuse(scope, send, error, started)
            return
        if self._draining is not None:
            await _refuse(scope, send, ServiceUnavailable("the server is shutting down; connect again"), started)
            return
        await send({"type": "websocket.accept"})
        deadline = asyncio.get_running_loop().time() + self.max_seconds
        client = scope.get("client")
        connection = Connection(
            resources, headers, principal, receive, send, self.max_message_bytes, deadline, self.metrics, self.held
        )
        connection.client_ip = client[0] if client else None
        writer = scope.get("extensions", {}).get(socket_protocol.TEXT_WRITER)
        connection.write_text = writer["write"] if writer else None
        self.open.add(connection)
        self.metrics.websocket_opened(PATH)
        try:
            if writer:
                writer["listen"](connection.heard)
            await connection.run()
        finally:
            if writer:
                writer["listen"](None)
            connection.hold(None)
            self.open.discard(connection)
            self.metrics.websocket_closed(PATH)

    async def aclose(self, grace_seconds: float) -> None:
        """Shutdown: every connection stops taking responses; those running finish within `grace_seconds`; then
        each closes with 1001 (going away)."""
        connections = list(self.open)
        for connection in connections:
            connection.stop()
        if connections:
            await asyncio.wait([asyncio.ensure_future(c.stopped.wait()) for c in connections], timeout=grace_seconds)
        for connection in connections:
            await connection.close(GOING_AWAY)


_REPORTED_STEP = 64 * 1024


class HeldContexts:
    """The chain context this process's connections hold, together, within a limit (STATESTORE_SOCKET_HELD_BYTES):
    a head past it is not held, and the continue from it reads its context as one over HTTP does."""

    def __init__(self, limit: int, metrics: Metrics) -> None:
        self.limit = limit
        self._report = metrics.websocket_held_bytes(PATH)
        self.total = 0
        self._step = 0  # the total's 64 KiB step when last reported

    def swap(self, given_back: int, taken: int) -> bool:
        """`given_back` bytes no longer held; whether `taken` more may be."""
        total = self.total - given_back
        held = total + taken <= self.limit
        self.total = total = total + taken if held else total
        # The gauge in 64 KiB steps (0 exactly): every socket turn moves the total, and a gauge's set is most of what
        # this accounting would cost it.
        step = (total + _REPORTED_STEP - 1) // _REPORTED_STEP
        if step != self._step:
            self._step = step
            self._report(total)
        return held


def _access_line(*, event: str, status: int, started: float, complete: bool, client_ip: str | None) -> None:
    """The access log's line for a handshake refused or a `response.create` answered, as the HTTP middleware writes
    one per request (statestore/middleware.py): status and time, never content. `status`: what the same request would
    have had over HTTP."""
    if not access_logger.isEnabledFor(logging.INFO):
        return
    access_logger.info(
        "request",
        extra={
            "method": "WEBSOCKET",
            "route": PATH,
            "event": event,
            "status": status,
            "duration_ms": round((time.perf_counter() - started) * 1000, 3),
            "complete": complete,
            "client_ip": client_ip,
        },
    )


async def _refuse(scope: Scope, send: Send, error: StatestoreError, started: float) -> None:
    """A refused handshake: the API's status and error body (the ASGI denial response), where the server can send
    one; else a close."""
    shaped = as_openai(error)
    request_id = new_request_id()
    client = scope.get("client")
    with _request_id(request_id):
        _access_line(
            event="handshake",
            status=shaped.status,
            started=started,
            complete=True,
            client_ip=client[0] if client else None,
        )
    if "websocket.http.response" not in scope.get("extensions", {}):
        await send({"type": "websocket.close", "code": 1008})
        return
    body = shaped.body(request_id)
    headers = [
        (b"content-type", b"application/json"),
        (b"request-id", request_id.encode()),
        *((name.encode(), value.encode()) for name, value in error.headers.items()),
    ]
    await send({"type": "websocket.http.response.start", "status": shaped.status, "headers": headers})
    await send({"type": "websocket.http.response.body", "body": body})


@contextlib.contextmanager
def _request_id(request_id: str) -> Iterator[None]:
    """The request id the log lines written meanwhile carry (one per `response.create`, as one per HTTP request)."""
    token = request_id_var.set(request_id)
    try:
        yield
    finally:
        request_id_var.reset(token)


def _error_event(error: StatestoreError, numbered: SocketEvents) -> bytes:
    """An `error` event as the SDK types it (ResponseWsError): the HTTP status the request would have had, and the
    error's body (with its headers, a retry-after, when it has any)."""
    shaped = as_openai(error)
    detail: dict[str, Any] = {
        "type": shaped.error_type,
        "code": shaped.code,
        "message": shaped.message,
        "param": shaped.param,
    }
    if error.headers:
        detail["headers"] = error.headers
    return numbered.frame({"type": "error", "status": shaped.status, "error": detail})


class Connection:
    def __init__(  # noqa: PLR0917 - one caller, which names them all
        self,
        resources: Resources,
        headers: Headers,
        principal: Principal,
        receive: Receive,
        send: Send,
        max_message_bytes: int,
        deadline: float,
        metrics: Metrics,
        held: HeldContexts,
    ) -> None:
        self.resources = resources
        self.metrics = metrics
        self.client_ip: str | None = None
        self.status: int | None = None  # of the response.create running: 200, or its error event's status
        self.headers = headers
        self.principal = principal
        self._receive = receive
        self._send = send
        self.max_message_bytes = max_message_bytes
        self.deadline = deadline
        self.expired = False  # the connection's time is up
        self._reading = False  # the reader waits for the next message
        self.worker: asyncio.Task[None] | None = None  # runs the responses, one after another
        self.kept: KeptResponse | None = None  # the last store: false response made here
        # The last stored chain head made here: its row, its parent's context and its own segment (joined only when a
        # continue names it). "The chain's head at hand": a continue from it reads no context from Redis.
        self.head: tuple[ResponseRow, bytes, bytes] | None = None
        self._held_contexts = held
        self._head_bytes = 0  # of `head`, taken from `_held_contexts`
        self.jobs: collections.deque[Job] = collections.deque()
        self._wake = asyncio.Event()
        self.running: tuple[SteerTarget, SocketEvents] | None = None
        self.waiting: dict[str, SteerTarget] = {}  # completed with calls to answer, steering input queued
        self.finished: collections.deque[str] = collections.deque(maxlen=_FINISHED_REMEMBERED)
        self.idle = SocketEvents()  # numbers the events that belong to no response
        self.stopping = False
        self.stopped = asyncio.Event()  # no response runs, none will
        self.closed = False
        self._sending = asyncio.Lock()
        self._sends_waiting = 0  # sends through ASGI not yet done: a frame written directly would overtake them
        # The server's own writer of text messages (statestore/socket_protocol.py), when it has one.
        self.write_text: Callable[[bytes], bool] | None = None

    async def run(self) -> None:
        self.worker = worker = asyncio.create_task(self._work())
        ending = "gone"
        try:
            ending = await self._read(worker)
        finally:
            if ending == "gone":
                worker.cancel()  # the client left: its running response is abandoned, nothing stored of it
            else:
                self.stop()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await worker
        if ending == "expired":
            await self.send_event(
                _error_event(
                    BadRequest(
                        "This connection reached its time limit; open a new connection to continue.",
                        code="websocket_connection_limit_reached",
                    ),
                    self.idle,
                )
            )
            await self.close(1000)

    def stop(self) -> None:
        """Take no new response: the running one finishes."""
        self.stopping = True
        self._wake.set()

    async def close(self, code: int) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(OSError, RuntimeError):
            await self._send({"type": "websocket.close", "code": code})

    async def send_event(self, frame: bytes) -> None:
        if self.closed:
            raise ConnectionResetError("the connection is closed")
        if not self._sends_waiting and self.write_text is not None and self.write_text(frame):
            return
        self._sends_waiting += 1
        try:
            async with self._sending:
                await self._send({"type": "websocket.send", "text": frame.decode()})
        finally:
            self._sends_waiting -= 1

    # -- reading ---------------------------------------------------------------------------------------------------

    async def _read(self, worker: asyncio.Task[None]) -> str:
        """Read events until the client leaves ("gone"), the connection's time is up ("expired") or it is closed
        here ("closed")."""
        loop = asyncio.get_running_loop()
        if self.deadline <= loop.time():
            return "expired"
        reader = asyncio.current_task()
        assert reader is not None
        # One timer for the connection's life, where a timeout around each read cost a timer per message; it cuts
        # short only a wait for the next message, never the handling of one.
        expiry = loop.call_at(self.deadline, self._expire, reader)
        try:
            while True:
                self._reading = True
                try:
                    message = await self._receive()
                except asyncio.CancelledError:
                    if self.expired and reader.uncancel() == 0:
                        return "expired"
                    raise
                finally:
                    self._reading = False
                if message["type"] == "websocket.disconnect":
                    return "gone"
                if self.closed or worker.done():
                    return "closed"
                data = message.get("text")
                if data is None:
                    data = message.get("bytes") or b""
                if len(data) > self.max_message_bytes:
                    await self.close(MESSAGE_TOO_BIG)
                    return "gone"
                await self._take(data)
                if self.expired:
                    return "expired"
        finally:
            expiry.cancel()

    def _expire(self, reader: asyncio.Task[Any]) -> None:
        self.expired = True
        if self._reading:
            reader.cancel()

    def heard(self, data: bytes) -> bool:
        """A whole text message as the server read it, before it is queued for `_read` (statestore/socket_protocol.py):
        a `response.create` that the reader, waiting with nothing else to do, would only hand to the worker is handed
        to it here (True); anything else (a steer, a bad event, one over the limit, a connection ending) is left to
        `_read` (False), which does with it all it ever did."""
        if (
            not self._reading
            or self.expired
            or self.closed
            or self.worker is None
            or self.worker.done()
            or len(data) > self.max_message_bytes
            or len(self.jobs) >= QUEUED_AT_MOST
        ):
            return False
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            return False
        if type(event) is not dict or event.get("type") != "response.create":
            return False
        self.jobs.append((event, []))
        self._wake.set()
        return True

    async def _take(self, data: str | bytes) -> None:
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            await self._refuse(BadRequest("We could not parse the JSON of your event.", code="invalid_json"))
            return
        if not isinstance(event, dict):
            await self._refuse(BadRequest("An event must be a JSON object.", code="invalid_json"))
            return
        kind = event.get("type")
        if kind == "response.create":
            if len(self.jobs) >= QUEUED_AT_MOST:
                await self._refuse(
                    RateLimited(
                        f"Too many responses are queued on this connection (at most {QUEUED_AT_MOST} wait behind the "
                        "running one); send the next when one has started.",
                        code="too_many_queued_responses",
                    )
                )
                return
            self.jobs.append((event, []))
            self._wake.set()
        elif kind == "response.steer":
            await self._steer(event)
        else:
            shown = kind[:64] if isinstance(kind, str) else kind
            await self._refuse(
                BadRequest(
                    f"Invalid value for 'type': {shown!r}; expected 'response.create' or 'response.steer'.",
                    param="type",
                    code="invalid_value",
                )
            )

    async def _refuse(self, error: StatestoreError) -> None:
        numbered = self.running[1] if self.running is not None else self.idle
        with contextlib.suppress(OSError):
            await self.send_event(_error_event(error, numbered))

    async def _fail(self, error: StatestoreError) -> None:
        """The running response.create ends with `error`'s event."""
        self.status = as_openai(error).status
        await self._refuse(error)

    # -- steering --------------------------------------------------------------------------------------------------

    async def _steer(self, event: dict[str, Any]) -> None:
        numbered = self.running[1] if self.running is not None else self.idle
        try:
            previous, raw, items = steering.read_steer(event)
        except SteerRefused as invalid:
            named = event.get("previous_response_id")
            failure = steering.failed(named if isinstance(named, str) else "", event.get("input"), **_why(invalid))
            await self.send_event(numbered.frame(failure))
            return
        running = self.running
        target = running[0] if running is not None and running[0].response_id == previous else None
        target = target or self.waiting.get(previous)
        refused: SteerRefused | None = None
        if target is None:
            refused = (
                SteerRefused("response_already_completed", "The response completed; send response.create instead.")
                if previous in self.finished
                else SteerRefused("response_not_found", f"No response with id '{previous}' runs on this connection.")
            )
        elif not target.supported:
            refused = SteerRefused(
                "steering_not_supported", "Responses on a conversation or compacting their context cannot be steered."
            )
        elif len(target.queued) >= steering.MAX_PENDING:
            refused = SteerRefused("too_many_pending_steers", "Too much steering input is pending for this response.")
        if refused is not None:
            await self.send_event(numbered.frame(steering.failed(previous, raw, **_why(refused))))
            return
        assert target is not None
        steer = steering.new_steer(previous, raw, items)
        target.queued.append(steer)
        await self.send_event(numbered.frame(steering.accepted(steer)))
        if target.waiting:
            await self.send_event(numbered.frame(steering.pending(steer, target.required)))

    # -- responses -------------------------------------------------------------------------------------------------

    async def _work(self) -> None:
        try:
            while True:
                while not self.jobs and not self.stopping:
                    self._wake.clear()
                    await self._wake.wait()
                if self.stopping:
                    return
                event, steers = self.jobs.popleft()
                # Each response.create counted and logged as an HTTP request is (`_access_line`), under a request id
                # of its own; here, not in a coroutine around `_respond`, which every resumption would pass through.
                started = time.perf_counter()
                self.status = None
                token = request_id_var.set(new_request_id())  # as `_request_id` does, without a generator
                try:
                    successor = await self._respond(event, steers)
                finally:
                    self._account(started, token)
                if successor is not None:
                    self.jobs.appendleft(successor)
        except (OSError, asyncio.CancelledError):
            raise  # the client left mid-send, or cancelled as it left
        except Exception:
            log.exception("WebSocket connection failed")
            await self.close(INTERNAL_ERROR)
        finally:
            self.stopped.set()

    def _account(self, started: float, token: contextvars.Token[str | None]) -> None:
        try:
            # No status: the client left (or the connection failed) before the response ended.
            status = self.status if self.status is not None else CLIENT_CLOSED_REQUEST
            self.metrics.count_websocket_response(status)
            _access_line(
                event="response.create",
                status=status,
                started=started,
                complete=self.status is not None,
                client_ip=self.client_ip,
            )
        finally:
            request_id_var.reset(token)

    async def _respond(self, event: dict[str, Any], steers: list[Steer]) -> Job | None:
        """Run one `response.create`; the automatic successor its steering input asks for, if any."""
        body = dict(event)
        del body["type"]  # "response.create": the event's, not the body's
        try:
            if body.get("background") is True:
                raise BadRequest(
                    "Unsupported parameter: 'background' is not supported in WebSocket mode.",
                    param="background",
                    code="unsupported_parameter",
                )
            if "stream_id" in body:
                raise BadRequest(
                    "Unsupported parameter: 'stream_id': responses on one connection run one after another.",
                    param="stream_id",
                    code="unsupported_parameter",
                )
            body["stream"] = True  # implicit over a socket
            previous = body.get("previous_response_id")
            waiting = self.waiting.pop(previous, None) if isinstance(previous, str) else None
            if waiting is not None and waiting.queued:
                # Accepted steering input goes first, in submission order (the SDK's response.steer.pending).
                steers = [*waiting.queued, *steers]
                body["input"] = [*_as_messages([s.raw for s in waiting.queued]), *_as_items(body.get("input"))]
            turn = turn_of_event(body)
        except StatestoreError as exc:
            previous = event.get("previous_response_id")
            self._evict(previous if isinstance(previous, str) else None)
            await self._fail(exc)
            await self._steers_failed(steers, "successor_creation_failed", exc.message)
            return None
        turns = turns_of(self.resources)
        try:
            prepared, upstream = await begin_turn(
                self.resources, self.headers, self.principal, turn, kept=self.kept, held=self._held(turn)
            )
        except _TURN_FAULTS as exc:
            self._evict(turn.previous_response_id)
            error = _statestore_error(exc)
            await self._fail(error)
            await self._steers_failed(steers, "successor_creation_failed", error.message)
            return None
        numbered = SocketEvents()
        target = SteerTarget(prepared.response_id, supported=turn.conversation_id is None and not turn.compaction)
        self.running = (target, numbered)
        events = turn_events(turns, prepared, upstream, numbered)
        completed = False
        write = self.write_text
        try:
            async for frame in events:
                # As `send_event`, without a coroutine a frame when the server's writer takes it.
                if self._sends_waiting or write is None or not write(frame):
                    await self.send_event(frame)
            completed = True
        except _TURN_FAULTS as exc:
            await self._fail(_statestore_error(exc))
        finally:
            self.running = None
            self.finished.append(prepared.response_id)
            await events.aclose()
            await end_turn(turns, prepared, upstream)
        queued = target.queued
        final = numbered.final
        if completed and final is not None:
            self.status = 200
        if not completed or final is None:
            self._evict(turn.previous_response_id)
            await self._steers_failed(queued, "response_not_active", "The response failed; the input was not used.")
            return None
        if not turn.store and turn.conversation_id is None:
            self.kept = keep(prepared, orjson.loads(final), final)  # replaces an older one
        elif prepared.stored is not None:
            row, segment = prepared.stored
            self.hold((row, prepared.context, segment))
        if not queued:
            return None
        required = steering.required_input(final)
        if required:
            target.waiting = True
            target.required = required
            self.waiting[prepared.response_id] = target
            for steer in queued:
                await self.send_event(numbered.frame(steering.pending(steer, required)))
            return None
        # The automatic successor: the response's own settings, continued with the queued input.
        inputs = _as_messages([s.raw for s in queued])
        return {**event, "previous_response_id": prepared.response_id, "input": inputs}, list(queued)

    def hold(self, head: tuple[ResponseRow, bytes, bytes] | None) -> None:
        """Hold `head` (the chain head this connection made last, its context and last segment) instead of the one
        held before, if the process's limit leaves room for it; None: hold nothing."""
        size = len(head[1]) + len(head[2]) if head is not None else 0
        if self._held_contexts.swap(self._head_bytes, size):
            self.head, self._head_bytes = head, size
        else:
            self.head, self._head_bytes = None, 0

    def _held(self, turn: TurnRequest) -> KeptResponse | None:
        """The chain head this connection made last, when `turn` continues it: Redis is still asked whether it serves
        that head (a deletion or a continue elsewhere since is a miss, and the turn reads as over HTTP)."""
        if self.head is None or turn.previous_response_id != self.head[0].id:
            return None
        row, context, segment = self.head
        return KeptResponse(row, join_segments([context, segment]))

    def _evict(self, previous: str | None) -> None:
        """A continuation that failed drops the connection's kept response it continued."""
        if self.kept is not None and previous == self.kept.row.id:
            self.kept = None

    async def _steers_failed(self, steers: list[Steer], code: str, message: str) -> None:
        for steer in steers:
            failure = steering.failed(steer.previous_response_id, steer.raw, code, message, steer.id)
            with contextlib.suppress(OSError):
                await self.send_event(self.idle.frame(failure))


def _why(refused: SteerRefused) -> dict[str, str]:
    return {"code": refused.code, "message": refused.message}


def _statestore_error(exc: BaseException) -> StatestoreError:
    if isinstance(exc, StatestoreError):
        return exc
    if isinstance(exc, StreamBrokenOff):
        return BackendError(str(exc), code="stream_broken_off")
    if isinstance(exc, UNSTORABLE_VALUE_ERRORS):
        return BadRequest("The request holds a value that cannot be stored.", code="invalid_value")
    return ServiceUnavailable("the response store is unavailable; try again shortly")


def _as_items(value: Any) -> list[Any]:
    """A create's `input` as a list of items (a string is one user message)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    return list(value) if isinstance(value, list) else [value]


def _as_messages(inputs: list[Any]) -> list[Any]:
    return [item for value in inputs for item in _as_items(value)]
