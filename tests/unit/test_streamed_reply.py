"""StreamedReply: a streamed body relayed as it is made, stopped when the client goes away, cleaned up however it
ends. Driven with an ASGI receive/send pair of our own, so a disconnect can be timed exactly."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

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


class Backend:
    """The backend's response the relay reads: `read` waits for the next chunk, and raises once it is closed, as
    aiohttp's reader does when its response is closed under it."""

    def __init__(self) -> None:
        self.chunks: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.closes = 0

    async def read(self) -> bytes | None:
        chunk = await self.chunks.get()
        if chunk is None:
            raise ConnectionError("Connection closed")
        return chunk

    async def close(self) -> None:
        self.closes += 1
        self.chunks.put_nowait(None)


async def test_relays_every_chunk_in_order_then_ends_and_cleans_up_once() -> None:
    client, closed, backend = Client(), Closed(), Backend()

    async def chunks() -> AsyncIterator[bytes]:
        for part in (b"event: a\n\n", b"event: b\n\n"):
            await asyncio.sleep(0)
            yield part

    reply = StreamedReply(chunks(), 200, [(b"content-type", b"text/event-stream")], closed, backend.close)
    await reply(SCOPE, client.receive, client.send)

    assert client.sent[0] == {
        "type": "http.response.start",
        "status": 200,
        "headers": [(b"content-type", b"text/event-stream")],
    }
    assert client.bodies() == [b"event: a\n\n", b"event: b\n\n", b""]
    assert client.sent[-1]["more_body"] is False
    assert closed.calls == 1
    assert backend.closes == 0  # the client never left: the response ended, which is not a disconnect


async def test_a_client_leaving_closes_the_backend_response_which_ends_the_relay() -> None:
    client, closed, backend = Client(), Closed(), Backend()
    stages: list[str] = []

    async def chunks() -> AsyncIterator[bytes]:
        try:
            while True:
                chunk = await backend.read()
                assert chunk is not None
                stages.append("relayed")
                yield chunk
        finally:
            await asyncio.sleep(0)  # the relay's own clean-up (the give-back) may await: nothing cancels it
            stages.append("body cleaned up")

    reply = StreamedReply(chunks(), 200, [], closed, backend.close)
    relay = asyncio.create_task(reply(SCOPE, client.receive, client.send))
    backend.chunks.put_nowait(b"first")
    while not stages:
        await asyncio.sleep(0)
    client.gone.set()  # the backend is slow with its next token; the client does not wait for it
    await asyncio.wait_for(relay, 5)  # returns, no exception: a client leaving is not an error

    assert backend.closes == 1
    assert stages == ["relayed", "body cleaned up"]
    assert client.bodies() == [b"first"]  # no end of body after the client left
    assert closed.calls == 1


async def test_a_step_under_way_when_the_client_leaves_runs_to_its_end() -> None:
    """The commit before message_stop must not be cut in half by a client leaving during it."""
    client, closed, backend = Client(), Closed(), Backend()
    committed: list[bool] = []
    committing = asyncio.Event()

    async def chunks() -> AsyncIterator[bytes]:
        yield b"delta"
        committing.set()
        await asyncio.sleep(0.05)  # the commit's round trip
        committed.append(True)
        yield b"message_stop"
        await backend.read()  # the rest of the backend's body
        yield b"never"

    reply = StreamedReply(chunks(), 200, [], closed, backend.close)
    relay = asyncio.create_task(reply(SCOPE, client.receive, client.send))
    await committing.wait()
    client.gone.set()
    await asyncio.wait_for(relay, 5)

    assert committed == [True]
    assert b"never" not in client.bodies()
    assert closed.calls == 1


async def test_a_client_gone_before_the_first_chunk_still_gets_the_clean_up() -> None:
    client, closed, backend = Client(), Closed(), Backend()
    client.gone.set()

    async def chunks() -> AsyncIterator[bytes]:
        await backend.read()
        yield b"never"

    reply = StreamedReply(chunks(), 200, [], closed, backend.close)
    await asyncio.wait_for(reply(SCOPE, client.receive, client.send), 5)
    assert closed.calls == 1
    assert client.bodies() == []


async def test_a_body_that_fails_while_the_client_is_there_raises_to_the_server_after_its_clean_up() -> None:
    client, closed, backend = Client(), Closed(), Backend()

    async def chunks() -> AsyncIterator[bytes]:
        yield b"part"
        raise RuntimeError("the backend broke off")

    reply = StreamedReply(chunks(), 200, [], closed, backend.close)
    with pytest.raises(RuntimeError, match="broke off"):
        await reply(SCOPE, client.receive, client.send)
    assert client.bodies() == [b"part"]
    assert closed.calls == 1
    assert backend.closes == 0


async def test_the_disconnect_watcher_is_gone_once_the_response_ends() -> None:
    """A finished response leaves no task behind reading `receive`."""
    client, closed = Client(), Closed()

    async def chunks() -> AsyncIterator[bytes]:
        yield b"only"

    before = len(asyncio.all_tasks())
    await StreamedReply(chunks(), 200, [], closed, None)(SCOPE, client.receive, client.send)
    await asyncio.sleep(0)
    assert len(asyncio.all_tasks()) == before
    assert client.receives <= 1
