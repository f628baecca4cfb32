"""StreamedReply: a streamed body relayed as it is made, stopped when the client goes away, cleaned up however it
ends. Driven with an ASGI receive/send pair of our own, so a disconnect can be timed exactly."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import anyio
import pytest
from starlette.types import Message

from statestore.api.responses import StreamedReply

SCOPE = {"type": "http", "asgi": {"spec_version": "2.3"}}


class Client:
    """The server side of one connection: `receive` blocks until the client leaves (or the response ends, as uvicorn
    reports it), `send` records what went out."""

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.gone = asyncio.Event()
        self.receives = 0

    async def receive(self) -> Message:
        self.receives += 1
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.gone.set()  # uvicorn answers a later receive with a disconnect once the response is complete

    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]


class Closed:
    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self) -> None:
        await asyncio.sleep(0)  # clean-up awaits (a give-back is a round trip); it must not be cut short
        self.calls += 1


async def test_relays_every_chunk_in_order_then_ends_and_cleans_up_once() -> None:
    client, closed = Client(), Closed()

    async def chunks() -> AsyncIterator[bytes]:
        for part in (b"event: a\n\n", b"event: b\n\n"):
            await asyncio.sleep(0)
            yield part

    reply = StreamedReply(chunks(), 200, [(b"content-type", b"text/event-stream")], closed)
    await reply(SCOPE, client.receive, client.send)

    assert client.sent[0] == {
        "type": "http.response.start",
        "status": 200,
        "headers": [(b"content-type", b"text/event-stream")],
    }
    assert client.bodies() == [b"event: a\n\n", b"event: b\n\n", b""]
    assert client.sent[-1]["more_body"] is False
    assert closed.calls == 1


async def test_a_client_leaving_stops_the_relay_and_runs_the_body_s_own_clean_up() -> None:
    client, closed = Client(), Closed()
    stages: list[str] = []
    waiting = asyncio.Event()

    async def chunks() -> AsyncIterator[bytes]:
        try:
            yield b"first"
            stages.append("waiting for the backend")
            waiting.set()
            await asyncio.sleep(30)  # a backend that is slow to produce the next token
            stages.append("never")
            yield b"second"
        finally:
            with anyio.CancelScope(shield=True):  # as the relays' own clean-ups are: the cancellation stands
                await asyncio.sleep(0)
                stages.append("body cleaned up")

    reply = StreamedReply(chunks(), 200, [], closed)
    relay = asyncio.create_task(reply(SCOPE, client.receive, client.send))
    await waiting.wait()
    client.gone.set()
    await asyncio.wait_for(relay, 5)  # returns, no exception: a client leaving is not an error

    assert stages == ["waiting for the backend", "body cleaned up"]
    assert client.bodies() == [b"first"]  # no end of body after the client left
    assert closed.calls == 1


async def test_a_shielded_step_finishes_although_the_client_left_during_it() -> None:
    """The commit before message_stop is shielded: a client leaving mid-commit must not cut it in half."""
    client, closed = Client(), Closed()
    committed: list[bool] = []
    committing = asyncio.Event()

    async def chunks() -> AsyncIterator[bytes]:
        yield b"delta"
        with anyio.CancelScope(shield=True):
            committing.set()
            await asyncio.sleep(0.05)
            committed.append(True)
        yield b"message_stop"
        await asyncio.sleep(30)

    reply = StreamedReply(chunks(), 200, [], closed)
    relay = asyncio.create_task(reply(SCOPE, client.receive, client.send))
    await committing.wait()
    client.gone.set()
    await asyncio.wait_for(relay, 5)

    assert committed == [True]
    assert closed.calls == 1


async def test_a_client_gone_before_the_first_chunk_still_gets_the_clean_up() -> None:
    client, closed = Client(), Closed()
    client.gone.set()
    started: list[bool] = []

    async def chunks() -> AsyncIterator[bytes]:
        started.append(True)
        await asyncio.sleep(30)
        yield b"never"

    reply = StreamedReply(chunks(), 200, [], closed)
    await asyncio.wait_for(reply(SCOPE, client.receive, client.send), 5)
    assert closed.calls == 1


async def test_a_body_that_fails_raises_to_the_server_after_its_clean_up() -> None:
    client, closed = Client(), Closed()

    async def chunks() -> AsyncIterator[bytes]:
        yield b"part"
        raise RuntimeError("the backend broke off")

    reply = StreamedReply(chunks(), 200, [], closed)
    with pytest.raises(RuntimeError, match="broke off"):
        await reply(SCOPE, client.receive, client.send)
    assert client.bodies() == [b"part"]
    assert closed.calls == 1


async def test_the_disconnect_watcher_is_gone_once_the_response_ends() -> None:
    """A finished response leaves no task behind reading `receive`."""
    client, closed = Client(), Closed()

    async def chunks() -> AsyncIterator[bytes]:
        yield b"only"

    before = len(asyncio.all_tasks())
    await StreamedReply(chunks(), 200, [], closed)(SCOPE, client.receive, client.send)
    await asyncio.sleep(0)
    assert len(asyncio.all_tasks()) == before
    assert client.receives <= 1
