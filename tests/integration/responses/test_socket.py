"""WebSocket mode on /v1/responses through the official SDK's `client.responses.connect()`: the same events as SSE,
continuations on one connection, `store: false` responses kept in the connection's memory only, bad frames, the
handshake's authentication, and stored responses that any server continues over HTTP."""

from __future__ import annotations

import re
import time
from typing import Any

import httpx
import openai
import orjson
import pytest
import websockets.sync.client
from websockets.exceptions import ConnectionClosed, InvalidStatus

from statestore.api.responses_socket import QUEUED_AT_MOST
from tests.integration.responses.conftest import WEATHER, Rows, chat_requests, other_key
from tests.integration.test_typescript_sdk import run_node
from tests.support.fake_backend import FakeBackend, chat_action
from tests.support.open_responses import event_problems, response_problems
from tests.support.server import REPO, StatestoreServer

FINAL = ("response.completed", "response.incomplete", "response.failed", "error")


def turn(connection: Any, **create: Any) -> list[Any]:
    """Send one response.create and read its events up to its last (the closing event, or an error)."""
    connection.response.create(**create)
    return until_final(connection)


def until_final(connection: Any) -> list[Any]:
    events = []
    for event in connection:
        events.append(event)
        if event.type in FINAL:
            return events
    raise AssertionError("the connection closed before the response ended")


def next_event(connection: Any) -> Any:
    return next(iter(connection))


def ws_url(server: StatestoreServer) -> str:
    return server.url.replace("http://", "ws://") + "/v1/responses"


def raw_turn(socket: Any, **create: Any) -> list[dict[str, Any]]:
    socket.send(orjson.dumps({"type": "response.create", **create}).decode())
    return raw_until_final(socket)


def raw_until_final(socket: Any) -> list[dict[str, Any]]:
    events = []
    while True:
        event = orjson.loads(socket.recv(timeout=30))
        events.append(event)
        if event["type"] in FINAL:
            return events


def test_a_connection_answers_each_create_with_the_events_of_sse_and_continues_the_chain(
    any_openai_client: openai.OpenAI, backend: FakeBackend
) -> None:
    client = any_openai_client
    streamed = [event.type for event in client.responses.create(model="echo-1", input="hello", stream=True)]
    with client.responses.connect() as connection:
        first = turn(connection, model="echo-1", input="hello", instructions="Be brief.")
        assert [event.type for event in first] == streamed
        assert [event.sequence_number for event in first] == list(range(len(first)))
        completed = first[-1].response
        assert completed.output_text == "echo: hello" and completed.status == "completed"
        second = turn(connection, model="echo-1", input="again", previous_response_id=completed.id)
        third = turn(connection, model="echo-1", input="third", previous_response_id=second[-1].response.id)
    assert third[-1].response.output_text == "echo: third"
    assert third[-1].response.previous_response_id == second[-1].response.id
    assert chat_requests(backend)[-1]["messages"] == [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "echo: hello"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "echo: again"},
        {"role": "user", "content": "third"},
    ]
    assert all(request["stream"] is True for request in chat_requests(backend)[1:])
    # Stored as any response is: retrieved and continued over HTTP.
    assert client.responses.retrieve(third[-1].response.id).output_text == "echo: third"
    fourth = client.responses.create(model="echo-1", input="fourth", previous_response_id=third[-1].response.id)
    assert fourth.output_text == "echo: fourth"
    assert len(chat_requests(backend)[-1]["messages"]) == 7


def test_a_response_stored_over_a_socket_is_continued_by_another_server_over_http(
    responses_server: StatestoreServer,
    responses_pg_url: str,
    redis_url: str,
    responses_redis_prefix: str,
    fake_backend_process: FakeBackend,
    backend: FakeBackend,
    api_key: str,
) -> None:
    client = openai.OpenAI(base_url=responses_server.url + "/v1", api_key=api_key, max_retries=0)
    with client, client.responses.connect() as connection:
        made = turn(connection, model="echo-1", input="over a socket")[-1].response
    replica = StatestoreServer(
        database_url=responses_pg_url,
        upstream_url=fake_backend_process.url,
        redis_url=redis_url,
        redis_prefix=responses_redis_prefix,
        env={"STATESTORE_CHAT_UPSTREAM_URL": fake_backend_process.url},
    )
    try:
        with openai.OpenAI(base_url=replica.url + "/v1", api_key=api_key, max_retries=0) as other:
            continued = other.responses.create(model="echo-1", input="over http", previous_response_id=made.id)
    finally:
        replica.stop()
    assert continued.output_text == "echo: over http"
    assert chat_requests(backend)[-1]["messages"][:2] == [
        {"role": "user", "content": "over a socket"},
        {"role": "assistant", "content": "echo: over a socket"},
    ]


def test_the_head_a_connection_holds_is_branched_or_refused_as_over_http_once_changed_elsewhere(
    openai_client: openai.OpenAI, backend: FakeBackend
) -> None:
    """A connection continues the chain it made from the head it holds, asking Redis only whether that head is still
    served (ResponseHeads.read_held): one continued elsewhere since is branched from with its own context, and one
    deleted since is refused as a continue over HTTP is."""
    client = openai_client
    with client.responses.connect() as connection:
        first = turn(connection, model="echo-1", input="one")[-1].response
        second = turn(connection, model="echo-1", input="two", previous_response_id=first.id)[-1].response
        elsewhere = client.responses.create(model="echo-1", input="elsewhere", previous_response_id=second.id)
        assert elsewhere.output_text == "echo: elsewhere"
        branched = turn(connection, model="echo-1", input="three", previous_response_id=second.id)[-1].response
        assert branched.output_text == "echo: three"
        context = [
            {"role": "user", "content": "one"},
            {"role": "assistant", "content": "echo: one"},
            {"role": "user", "content": "two"},
            {"role": "assistant", "content": "echo: two"},
        ]
        assert chat_requests(backend)[-1]["messages"] == [*context, {"role": "user", "content": "three"}]
        held = turn(connection, model="echo-1", input="four", previous_response_id=branched.id)[-1].response
        assert chat_requests(backend)[-1]["messages"] == [
            *context,
            {"role": "user", "content": "three"},
            {"role": "assistant", "content": "echo: three"},
            {"role": "user", "content": "four"},
        ]
        client.responses.delete(held.id)
        with pytest.raises(openai.BadRequestError) as over_http:
            client.responses.create(model="echo-1", input="five", previous_response_id=held.id)
        refused = turn(connection, model="echo-1", input="five", previous_response_id=held.id)
        assert [event.type for event in refused] == ["error"]
        assert refused[-1].error.code == "previous_response_not_found" == over_http.value.code
        assert refused[-1].error.message == over_http.value.body["message"]  # type: ignore[index]
        # The connection goes on, from any response of the chain.
        again = turn(connection, model="echo-1", input="six", previous_response_id=branched.id)[-1].response
        assert again.output_text == "echo: six"


def test_a_store_false_response_is_continued_on_its_connection_only(
    any_openai_client: openai.OpenAI, backend: FakeBackend, api_key: str
) -> None:
    client = any_openai_client
    with client.responses.connect() as connection, client.responses.connect() as elsewhere:
        first = turn(connection, model="echo-1", input="unstored", store=False)[-1].response
        second = turn(connection, model="echo-1", input="next", store=False, previous_response_id=first.id)
        assert second[-1].type == "response.completed"
        assert chat_requests(backend)[-1]["messages"] == [
            {"role": "user", "content": "unstored"},
            {"role": "assistant", "content": "echo: unstored"},
            {"role": "user", "content": "next"},
        ]
        # A newer one replaces the older: only the last is kept.
        older = turn(connection, model="echo-1", input="x", store=False, previous_response_id=first.id)
        assert older[-1].type == "error" and older[-1].error.code == "previous_response_not_found"
        # Another connection, and HTTP, know nothing of it.
        refused = turn(elsewhere, model="echo-1", input="y", store=False, previous_response_id=second[-1].response.id)
        assert refused[-1].type == "error" and refused[-1].status == 400
        assert refused[-1].error.code == "previous_response_not_found"
        assert refused[-1].error.param == "previous_response_id"
        # A stored response cannot continue it: that would store a chain whose start is nowhere.
        stored = turn(connection, model="echo-1", input="z", previous_response_id=second[-1].response.id)
        assert stored[-1].type == "error" and stored[-1].error.param == "store"
        # ... and, as any failed continuation, that evicted it from the connection's memory.
        evicted = turn(connection, model="echo-1", input="3", store=False, previous_response_id=second[-1].response.id)
        assert evicted[-1].type == "error" and evicted[-1].error.code == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second[-1].response.id)


def test_a_failed_continuation_evicts_the_kept_response(any_openai_client: openai.OpenAI, backend: FakeBackend) -> None:
    client = any_openai_client
    with client.responses.connect() as connection:
        first = turn(connection, model="echo-1", input="kept", store=False)[-1].response
        backend.script({"kind": "error", "path": "/v1/chat/completions", "status": 500,
                        "error": {"type": "server_error", "message": "down"}})  # fmt: skip
        failed = turn(connection, model="echo-1", input="fails", store=False, previous_response_id=first.id)
        assert failed[-1].type == "error" and failed[-1].status >= 500
        again = turn(connection, model="echo-1", input="again", store=False, previous_response_id=first.id)
        assert again[-1].type == "error" and again[-1].error.code == "previous_response_not_found"
        # The connection goes on.
        fresh = turn(connection, model="echo-1", input="fresh", store=False)
        assert fresh[-1].response.output_text == "echo: fresh"


def test_background_and_bad_frames_get_error_events_and_the_connection_stays_usable(
    responses_server: StatestoreServer, api_key: str, backend: FakeBackend
) -> None:
    headers = {"authorization": f"Bearer {api_key}"}
    with websockets.sync.client.connect(ws_url(responses_server), additional_headers=headers) as socket:
        background = raw_turn(socket, model="echo-1", input="later", background=True)
        assert background == [
            {
                "type": "error",
                "status": 400,
                "error": {
                    "type": "invalid_request_error",
                    "code": "unsupported_parameter",
                    "message": "Unsupported parameter: 'background' is not supported in WebSocket mode.",
                    "param": "background",
                },
                "sequence_number": 0,
            }
        ]
        for frame, code in [
            ("{not json", "invalid_json"),
            ("[1, 2]", "invalid_json"),
            ('{"type": "nope"}', "invalid_value"),
        ]:
            socket.send(frame)
            event = orjson.loads(socket.recv(timeout=30))
            assert event["type"] == "error" and event["error"]["code"] == code, event
        unknown = raw_turn(socket, model="echo-1", input="x", temperature="hot")
        assert unknown[-1]["status"] == 400 and unknown[-1]["error"]["param"] == "temperature"
        steer = {"type": "response.steer", "previous_response_id": "resp_nothing", "input": "late"}
        socket.send(orjson.dumps(steer).decode())
        failed = orjson.loads(socket.recv(timeout=30))
        assert failed["type"] == "response.steer.failed" and failed["error"]["code"] == "response_not_found"
        assert failed["steer"] == {"input": "late", "previous_response_id": "resp_nothing"}
        done = raw_turn(socket, model="echo-1", input="still here")
        assert done[-1]["type"] == "response.completed"
        assert done[-1]["response"]["output"][0]["content"][0]["text"] == "echo: still here"


def test_a_message_over_the_body_limit_closes_the_connection_with_1009(
    tmp_path_factory: pytest.TempPathFactory, fake_backend_process: FakeBackend, api_key: str
) -> None:
    from statestore.store.migrate import upgrade

    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('socket-limits') / 'statestore.db'}"
    upgrade(url)
    server = StatestoreServer(
        database_url=url,
        upstream_url=fake_backend_process.url,
        env={
            "STATESTORE_CHAT_UPSTREAM_URL": fake_backend_process.url,
            "STATESTORE_MAX_BODY_BYTES": "4096",
            "STATESTORE_SOCKET_MAX_SECONDS": "6",
        },
    )
    headers = {"authorization": f"Bearer {api_key}"}
    try:
        with websockets.sync.client.connect(ws_url(server), additional_headers=headers) as socket:
            assert raw_turn(socket, model="echo-1", input="small")[-1]["type"] == "response.completed"
            socket.send(orjson.dumps({"type": "response.create", "model": "echo-1", "input": "x" * 5000}).decode())
            with pytest.raises(ConnectionClosed) as closed:
                socket.recv(timeout=30)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
        # The connection's time limit: an error event, then a close.
        with websockets.sync.client.connect(ws_url(server), additional_headers=headers) as socket:
            started = time.monotonic()
            event = orjson.loads(socket.recv(timeout=30))
            assert event["type"] == "error" and event["error"]["code"] == "websocket_connection_limit_reached"
            assert 5.5 < time.monotonic() - started < 20
            with pytest.raises(ConnectionClosed):
                socket.recv(timeout=30)
    finally:
        server.stop()


@pytest.mark.parametrize("header", ["authorization", "x-api-key"])
def test_the_handshake_is_authenticated_and_a_refusal_gets_the_apis_status_and_body(
    responses_server: StatestoreServer, api_key: str, header: str
) -> None:
    with pytest.raises(InvalidStatus) as refused:
        websockets.sync.client.connect(ws_url(responses_server)).close()
    assert refused.value.response.status_code == 401
    body = orjson.loads(refused.value.response.body or b"")
    assert body["error"]["code"] == "invalid_api_key" and body["error"]["type"] == "invalid_request_error"
    credential = f"Bearer {api_key}" if header == "authorization" else api_key
    with websockets.sync.client.connect(ws_url(responses_server), additional_headers={header: credential}) as socket:
        made = raw_turn(socket, model="echo-1", input="mine")[-1]["response"]
    # The owner is the credential's, whichever header carried it: the response is the key's, and no other's.
    mine = httpx.get(
        f"{responses_server.url}/v1/responses/{made['id']}", headers={"authorization": f"Bearer {api_key}"}
    )
    assert mine.status_code == 200
    theirs = httpx.get(f"{responses_server.url}/v1/responses/{made['id']}", headers={"x-api-key": other_key()})
    assert theirs.status_code == 404


def test_a_client_that_leaves_mid_response_leaves_no_row(
    responses_server: StatestoreServer, api_key: str, backend: FakeBackend, rows: Rows
) -> None:
    backend.script({"kind": "echo", "path": "/v1/chat/completions", "stall_after_events": 1, "stall_seconds": 1.5})
    headers = {"authorization": f"Bearer {api_key}"}
    with websockets.sync.client.connect(ws_url(responses_server), additional_headers=headers) as socket:
        socket.send(orjson.dumps({"type": "response.create", "model": "echo-1", "input": "leaving"}).decode())
        assert orjson.loads(socket.recv(timeout=30))["type"] == "response.created"
    time.sleep(2.5)
    import asyncio

    assert asyncio.run(rows.counts(api_key))["responses"] == 0
    # The server goes on serving.
    with websockets.sync.client.connect(ws_url(responses_server), additional_headers=headers) as socket:
        assert raw_turn(socket, model="echo-1", input="back")[-1]["type"] == "response.completed"
    assert asyncio.run(rows.counts(api_key))["responses"] == 1


@pytest.mark.parametrize("compression", ["off", "on"])
def test_each_event_is_a_message_of_its_own_compressed_or_not(
    responses_server: StatestoreServer,
    tmp_path_factory: pytest.TempPathFactory,
    fake_backend_process: FakeBackend,
    api_key: str,
    compression: str,
) -> None:
    """A turn's events leave in few writes (statestore/socket_protocol.py), framed by statestore where nothing is
    negotiated (permessage-deflate is off unless STATESTORE_SOCKET_COMPRESSION turns it on, though the client offers
    it as the SDKs do) and by websockets where it is: either way one message an event, in order."""
    server = responses_server
    if compression == "on":
        from statestore.store.migrate import upgrade

        url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('socket-deflate') / 'statestore.db'}"
        upgrade(url)
        server = StatestoreServer(
            database_url=url,
            upstream_url=fake_backend_process.url,
            env={"STATESTORE_CHAT_UPSTREAM_URL": fake_backend_process.url, "STATESTORE_SOCKET_COMPRESSION": "true"},
        )
    headers = {"authorization": f"Bearer {api_key}"}
    try:
        with websockets.sync.client.connect(
            ws_url(server), additional_headers=headers, compression="deflate"
        ) as socket:
            assert [e.name for e in socket.protocol.extensions] == (
                ["permessage-deflate"] if compression == "on" else []
            )
            first = raw_turn(socket, model="echo-1", input="x" * 70_000)  # a frame with a 64-bit length
            events = raw_turn(socket, model="echo-1", input="again", previous_response_id=first[-1]["response"]["id"])
    finally:
        if server is not responses_server:
            server.stop()
    assert [event["type"] for event in events] == [event["type"] for event in first]
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.completed"
    assert first[-1]["response"]["output"][0]["content"][0]["text"] == "echo: " + "x" * 70_000


def _open_sockets(server: StatestoreServer) -> float:
    metrics = httpx.get(server.url + "/metrics").text
    return float(metrics.split('websocket_connections{route="/v1/responses"} ', 1)[1].split()[0])


def _answered(server: StatestoreServer, status: int) -> float:
    found = re.search(rf'websocket_responses_total{{status="{status}"}} (\S+)', httpx.get(server.url + "/metrics").text)
    return float(found.group(1)) if found else 0.0


def _settled(read: Any, expected: float) -> None:
    deadline = time.monotonic() + 10
    while read() != expected:  # a close is seen by the server a moment after the client's returns
        assert time.monotonic() < deadline, read()
        time.sleep(0.05)


def test_each_response_create_is_an_access_line_and_open_sockets_a_metric(
    responses_server: StatestoreServer, api_key: str, backend: FakeBackend
) -> None:
    """As an HTTP request is counted and logged: one access line per response.create (its status, time and a request
    id of its own, never its content), one per refused handshake, and the connections open as a gauge."""
    server = responses_server
    logged = len(server.log())
    before = {status: _answered(server, status) for status in (200, 400, 499)}
    open_before = _open_sockets(server)
    with pytest.raises(InvalidStatus):
        websockets.sync.client.connect(ws_url(server)).close()
    headers = {"authorization": f"Bearer {api_key}"}
    with websockets.sync.client.connect(ws_url(server), additional_headers=headers) as socket:
        assert _open_sockets(server) == open_before + 1
        made = raw_turn(socket, model="echo-1", input="a tangerine secret")[-1]
        assert made["type"] == "response.completed"
        refused = raw_turn(socket, model="echo-1", input="more", previous_response_id="resp_" + "0" * 24)[-1]
        assert refused["type"] == "error" and refused["status"] == 400
        backend.script({"kind": "echo", "path": "/v1/chat/completions", "stall_after_events": 1, "stall_seconds": 1.5})
        socket.send(orjson.dumps({"type": "response.create", "model": "echo-1", "input": "leaving"}).decode())
        assert orjson.loads(socket.recv(timeout=30))["type"] == "response.created"
    _settled(lambda: _open_sockets(server), open_before)
    _settled(lambda: _answered(server, 499), before[499] + 1)
    assert _answered(server, 200) == before[200] + 1 and _answered(server, 400) == before[400] + 1
    lines = [orjson.loads(line) for line in server.log()[logged:].splitlines() if line.startswith("{")]
    access = [line for line in lines if line["logger"] == "statestore.access" and line.get("method") == "WEBSOCKET"]
    assert [(line["event"], line["status"], line["complete"]) for line in access] == [
        ("handshake", 401, True),
        ("response.create", 200, True),
        ("response.create", 400, True),
        ("response.create", 499, False),
    ]
    assert all(line["route"] == "/v1/responses" and line["duration_ms"] > 0 for line in access)
    assert len({line["request_id"] for line in access}) == 4
    assert not [line for line in lines if "tangerine" in orjson.dumps(line).decode()]


def test_past_the_queue_bound_a_response_create_gets_an_error_event(
    responses_server: StatestoreServer, backend: FakeBackend, api_key: str
) -> None:
    """Responses on a connection run one after another, and at most QUEUED_AT_MOST response.create events wait
    behind the running one: one more gets an `error` event (429, too_many_queued_responses) instead of being held
    in memory; the queued ones all run, in order."""
    backend.script({"kind": "echo", "path": "/v1/chat/completions", "stall_after_events": 1, "stall_seconds": 2})
    headers = {"authorization": f"Bearer {api_key}"}
    with websockets.sync.client.connect(ws_url(responses_server), additional_headers=headers) as socket:
        socket.send(orjson.dumps({"type": "response.create", "model": "echo-1", "input": "running"}).decode())
        assert orjson.loads(socket.recv(timeout=30))["type"] == "response.created"
        for n in range(QUEUED_AT_MOST + 3):
            socket.send(orjson.dumps({"type": "response.create", "model": "echo-1", "input": f"queued {n}"}).decode())
        ends: list[dict[str, Any]] = []
        while len(ends) < 1 + QUEUED_AT_MOST + 3:
            event = orjson.loads(socket.recv(timeout=30))
            if event["type"] in FINAL:
                ends.append(event)
    errors = [event for event in ends if event["type"] == "error"]
    assert [(e["status"], e["error"]["code"], e["error"]["type"]) for e in errors] == [
        (429, "too_many_queued_responses", "rate_limit_error")
    ] * 3
    completed = [event["response"]["output"][0]["content"][0]["text"] for event in ends if event["type"] != "error"]
    assert completed == ["echo: running"] + [f"echo: queued {n}" for n in range(QUEUED_AT_MOST)]


def _held_bytes(server: StatestoreServer) -> float:
    metrics = httpx.get(server.url + "/metrics").text
    return float(metrics.split('\nwebsocket_held_bytes{route="/v1/responses"} ', 1)[1].split()[0])


def test_the_contexts_connections_hold_stay_within_the_process_limit(
    responses_pg_url: str, redis_url: str, responses_redis_prefix: str, backend: FakeBackend, api_key: str
) -> None:
    """A connection holds the chain head it made last, with its context, while the process's connections together
    stay within STATESTORE_SOCKET_HELD_BYTES: a head past it is not held, and the continue from it reads its context
    as over HTTP, whole. What a connection held is given back when it closes."""
    server = StatestoreServer(
        database_url=responses_pg_url,
        upstream_url=backend.url,
        redis_url=redis_url,
        redis_prefix=responses_redis_prefix,
        env={"STATESTORE_CHAT_UPSTREAM_URL": backend.url, "STATESTORE_SOCKET_HELD_BYTES": "2000"},
    )
    headers = {"authorization": f"Bearer {api_key}"}
    try:
        assert _held_bytes(server) == 0
        with websockets.sync.client.connect(ws_url(server), additional_headers=headers) as socket:
            first = raw_turn(socket, model="echo-1", input="small")[-1]["response"]
            assert 0 < _held_bytes(server) <= 2000
            large = raw_turn(socket, model="echo-1", input="x" * 3000, previous_response_id=first["id"])[-1]
            assert _held_bytes(server) == 0  # its context is past the limit
            last = raw_turn(socket, model="echo-1", input="after", previous_response_id=large["response"]["id"])[-1]
            assert last["type"] == "response.completed"
            assert chat_requests(backend)[-1]["messages"] == [
                {"role": "user", "content": "small"},
                {"role": "assistant", "content": "echo: small"},
                {"role": "user", "content": "x" * 3000},
                {"role": "assistant", "content": "echo: " + "x" * 3000},
                {"role": "user", "content": "after"},
            ]
        with websockets.sync.client.connect(ws_url(server), additional_headers=headers) as socket:
            assert raw_turn(socket, model="echo-1", input="small")[-1]["type"] == "response.completed"
            assert _held_bytes(server) > 0
        _settled(lambda: _held_bytes(server), 0)
    finally:
        server.stop()


def test_a_function_call_round_trip_over_a_socket(any_openai_client: openai.OpenAI, backend: FakeBackend) -> None:
    backend.script(
        chat_action(
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
            finish_reason="tool_calls",
        )
    )  # fmt: skip
    with any_openai_client.responses.connect() as connection:
        called = turn(connection, model="echo-1", input="weather?", tools=[WEATHER])[-1].response
        call = called.output[0]
        assert call.type == "function_call" and call.arguments == '{"city":"Paris"}'
        answered = turn(
            connection,
            model="echo-1",
            tools=[WEATHER],
            previous_response_id=called.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        )
    assert answered[-1].type == "response.completed"
    assert chat_requests(backend)[-1]["messages"][-1] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}


STALLED = {"stall_after_events": 1, "stall_seconds": 1.0}  # the reply pauses after its first chunk: time to steer


def test_steering_input_is_accepted_and_continues_the_response_in_order(
    any_openai_client: openai.OpenAI, backend: FakeBackend
) -> None:
    client = any_openai_client
    backend.script({"kind": "echo", "path": "/v1/chat/completions", **STALLED})
    with client.responses.connect() as connection:
        connection.response.create(model="echo-1", input="start", instructions="Be brief.", max_output_tokens=64)
        created = next_event(connection)
        assert created.type == "response.created"
        running = created.response.id
        connection.response.steer(previous_response_id=running, input="first steer")
        connection.response.steer(
            previous_response_id=running,
            input=[{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "second steer"}]}],
        )
        events = until_final(connection)
        accepted = [e for e in events if e.type == "response.steer.accepted"]
        assert [e.steer.previous_response_id for e in accepted] == [running, running]
        assert events[-1].type == "response.completed" and events[-1].response.id == running
        # The automatic successor: the queued input, in submission order, continuing the steered response.
        successor_events = until_final(connection)
    assert successor_events[0].type == "response.created"
    successor = successor_events[-1].response
    assert successor.previous_response_id == running and successor.output_text == "echo: second steer"
    assert successor.instructions == "Be brief." and successor.max_output_tokens == 64
    assert chat_requests(backend)[-1]["messages"][-4:] == [
        {"role": "user", "content": "start"},
        {"role": "assistant", "content": "echo: start"},
        {"role": "user", "content": "first steer"},
        {"role": "user", "content": "second steer"},
    ]
    stored = client.responses.input_items.list(successor.id, order="asc")
    assert [item.model_dump()["content"][0]["text"] for item in stored.data] == ["first steer", "second steer"]


def test_steering_a_response_that_calls_functions_waits_for_their_outputs(
    any_openai_client: openai.OpenAI, backend: FakeBackend
) -> None:
    client = any_openai_client
    call = {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}
    backend.script(
        chat_action({"role": "assistant", "content": None, "tool_calls": [call]}, finish_reason="tool_calls", **STALLED)
    )
    with client.responses.connect() as connection:
        connection.response.create(model="echo-1", input="weather?", tools=[WEATHER])
        running = next_event(connection).response.id
        connection.response.steer(previous_response_id=running, input="in celsius")
        events = until_final(connection)
        assert events[-1].type == "response.completed"
        pending = next_event(connection)
        assert pending.type == "response.steer.pending" and pending.reason == "waiting_for_required_input"
        assert [(r.type, r.call_id, r.name) for r in pending.required_input] == [
            ("function_call_output", "call_9", "get_weather")
        ]
        accepted = next(e for e in events if e.type == "response.steer.accepted")
        assert pending.steer.id == accepted.steer.id
        answered = turn(
            connection,
            model="echo-1",
            tools=[WEATHER],
            previous_response_id=running,
            input=[{"type": "function_call_output", "call_id": "call_9", "output": "12C"}],
        )
        assert answered[-1].type == "response.completed"
        # Steering a finished response is refused, handing the input back.
        connection.response.steer(previous_response_id=running, input="too late")
        late = next_event(connection)
    assert late.type == "response.steer.failed" and late.error.code == "response_already_completed"
    assert late.steer.input == "too late"
    assert chat_requests(backend)[-1]["messages"][-2:] == [
        {"role": "user", "content": "in celsius"},
        {"role": "tool", "tool_call_id": "call_9", "content": "12C"},
    ]


def test_shutdown_lets_the_running_response_finish_then_closes_with_1001(
    tmp_path_factory: pytest.TempPathFactory, fake_backend_process: FakeBackend, backend: FakeBackend, api_key: str
) -> None:
    import signal

    from statestore.store.migrate import upgrade

    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('socket-shutdown') / 'statestore.db'}"
    upgrade(url)
    server = StatestoreServer(
        database_url=url,
        upstream_url=fake_backend_process.url,
        env={"STATESTORE_CHAT_UPSTREAM_URL": fake_backend_process.url},
    )
    backend.script({"kind": "echo", "path": "/v1/chat/completions", **STALLED})
    headers = {"authorization": f"Bearer {api_key}"}
    try:
        with websockets.sync.client.connect(ws_url(server), additional_headers=headers) as socket:
            socket.send(orjson.dumps({"type": "response.create", "model": "echo-1", "input": "finishing"}).decode())
            assert orjson.loads(socket.recv(timeout=30))["type"] == "response.created"
            server.process.send_signal(signal.SIGTERM)
            events = raw_until_final(socket)
            assert events[-1]["type"] == "response.completed"
            with pytest.raises(ConnectionClosed) as closed:
                socket.recv(timeout=30)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
        # uvicorn ends by raising the signal it stopped on, once its shutdown is done.
        assert server.process.wait(timeout=30) == -signal.SIGTERM
    finally:
        server.stop()


def test_the_docs_example_runs(responses_sqlite_server: StatestoreServer, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/responses.md's WebSocket mode example, as written, against a server."""
    page = (REPO / "docs" / "responses.md").read_text()
    section = page[page.index("## WebSocket mode") :]
    example = section[section.index("```python\n") + len("```python\n") : section.index("```\n", 10)]
    assert "client.responses.connect()" in example
    exec(compile(example.replace("http://127.0.0.1:8080", responses_sqlite_server.url), "responses.md", "exec"), {})
    assert capsys.readouterr().out == "echo: And again\n"


def test_typescript_responses_over_a_websocket(
    responses_server: StatestoreServer, backend: FakeBackend, api_key: str
) -> None:
    """`ResponsesWS` of the `openai` TypeScript SDK: a chain on one connection, a store: false continuation kept on
    it, and a steered response continued by its automatic successor."""
    backend.script(
        {"kind": "echo", "path": "/v1/chat/completions"},
        {"kind": "echo", "path": "/v1/chat/completions"},
        {"kind": "echo", "path": "/v1/chat/completions", "stall_after_events": 1, "stall_seconds": 1.0},
    )
    seen = run_node(
        REPO / "tests" / "node" / "responses_socket.mjs", {"STATESTORE_URL": responses_server.url, "API_KEY": api_key}
    )
    assert seen["first"][:2] == ["response.created", "response.in_progress"]
    assert seen["first"][-1] == "response.completed"
    assert seen["firstText"] == "echo: hello" and seen["secondText"] == "echo: unstored"
    assert "response.steer.accepted" in seen["third"] and seen["third"][-1] == "response.completed"
    assert seen["successor"]["previous"] == seen["successor"]["thirdId"]
    assert seen["successor"]["text"] == "echo: and this"
    # The store: false responses were never stored.
    missing = httpx.get(f"{responses_server.url}/v1/responses/{seen['secondId']}", headers={"x-api-key": api_key})
    assert missing.status_code == 404


def test_every_event_and_response_over_a_socket_validates_against_the_specification(
    responses_server: StatestoreServer, api_key: str, backend: FakeBackend
) -> None:
    """The Open Responses document holds a socket's events as it holds SSE's: a text turn, a function call, its
    continuation and a store: false turn, every event and every Response they carry."""
    headers = {"authorization": f"Bearer {api_key}"}
    with websockets.sync.client.connect(ws_url(responses_server), additional_headers=headers) as socket:
        text = raw_turn(socket, model="echo-1", input="hello", instructions="Be brief.", temperature=0.3)
        backend.script(
            chat_action(
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "call_1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
                finish_reason="tool_calls",
            )
        )  # fmt: skip
        called = raw_turn(socket, model="echo-1", input="weather?", tools=[WEATHER])
        call = called[-1]["response"]["output"][0]
        answered = raw_turn(
            socket,
            model="echo-1",
            tools=[WEATHER],
            previous_response_id=called[-1]["response"]["id"],
            input=[{"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}],
        )
        unstored = raw_turn(socket, model="echo-1", input="not kept", store=False)
    turns = [text, called, answered, unstored]
    assert [events[-1]["type"] for events in turns] == ["response.completed"] * 4
    assert call["type"] == "function_call"
    for events in turns:
        assert {"response.created", "response.in_progress"} <= {event["type"] for event in events}
        for event in events:
            assert not event_problems(event), f"{event['type']}: {event_problems(event)[:5]}"
            if "response" in event:
                assert not response_problems(event["response"]), response_problems(event["response"])[:5]
    assert text[-1]["response"]["temperature"] == 0.3
