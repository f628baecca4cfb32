"""statestore/socket_protocol.py's reads: once the app listens (the scope's `statestore.websocket.text` extension),
the protocol splits received frames itself and offers each whole text message to the app's taker; every other frame
goes to websockets whole. Whatever way the bytes arrive (one at a time, all at once), every message reaches the app
once and in the order sent, control frames are answered, and a bad frame fails the connection as websockets fails it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from websockets.client import ClientProtocol
from websockets.frames import Close, Frame, Opcode

from statestore.socket_protocol import TEXT_WRITER
from tests.support.websocket_peer import serve


class Peer:
    """A server protocol with an app that takes the messages starting with `take` and reads the rest through ASGI,
    and a client (websockets' own protocol) that talks to it."""

    def __init__(self, *, max_size: int = 1 << 20) -> None:
        self.seen: list[tuple[str, bytes]] = []  # ("taken" | "received", the message) in the order the app got them
        self.accepted = asyncio.Event()
        self.done = asyncio.Event()
        self.closed_with: int | None = None

        async def app(scope: Any, receive: Any, send: Any) -> None:
            await receive()
            await send({"type": "websocket.accept"})
            scope["extensions"][TEXT_WRITER]["listen"](self.take)
            self.accepted.set()
            while True:
                message = await receive()
                if message["type"] == "websocket.disconnect":
                    self.closed_with = message.get("code")
                    break
                data = message.get("bytes")
                self.seen.append(("received", data if data is not None else message["text"].encode()))
            self.done.set()

        self.protocol, self.transport, self.client = serve(app, max_size=max_size)
        self.request = b"".join(self.client.data_to_send())
        self.read = 0  # of the transport's writes, those the client has read

    def take(self, payload: bytes) -> bool:
        if not payload.startswith(b"take"):
            return False
        try:
            payload.decode()
        except UnicodeDecodeError:
            return False
        self.seen.append(("taken", payload))
        return True

    async def open(self, *, with_request: bytes = b"") -> None:
        self.protocol.data_received(self.request + with_request)
        await asyncio.wait_for(self.accepted.wait(), timeout=5)
        self.client_reads()

    def client_reads(self) -> list[Frame]:
        self.client.receive_data(b"".join(self.transport.writes[self.read :]))
        self.read = len(self.transport.writes)
        return [event for event in self.client.events_received() if isinstance(event, Frame)]

    async def feed(self, data: bytes, chunk: int) -> None:
        for start in range(0, len(data), chunk):
            self.protocol.data_received(data[start : start + chunk])
            await asyncio.sleep(0)  # the app reads what was queued meanwhile, as it would between reads
        for _ in range(5):
            await asyncio.sleep(0)


def _frames(client: ClientProtocol, *frames: Frame) -> bytes:
    for frame in frames:
        client.send_frame(frame)
    return b"".join(client.data_to_send())


SENT = [b"take:1", b"keep:2", b"take:3 caf\xc3\xa9", b"x" * 300, b"take:5" + b"y" * 70000, b"take:6" + b"z" * 200]


def _conversation(client: ClientProtocol) -> list[bytes]:
    """The messages of SENT with a ping between, one as a binary message and one in two fragments: each frame's
    bytes."""
    frames = [
        Frame(Opcode.TEXT, SENT[0]),
        Frame(Opcode.PING, b"are you there"),
        Frame(Opcode.TEXT, SENT[1]),
        Frame(Opcode.TEXT, SENT[2][:5], fin=False),
        Frame(Opcode.CONT, SENT[2][5:]),
        Frame(Opcode.BINARY, SENT[3]),
        Frame(Opcode.TEXT, SENT[4]),
        Frame(Opcode.TEXT, SENT[5]),
    ]
    return [_frames(client, frame) for frame in frames]


@pytest.mark.parametrize("chunk", [0, 1, 2, 3, 7, 126, 1000, 1 << 20])  # 0: a read a frame
def test_every_message_reaches_the_app_once_and_in_order_however_the_bytes_arrive(chunk: int) -> None:
    async def scenario() -> tuple[list[tuple[str, bytes]], list[Frame]]:
        peer = Peer()
        await peer.open()
        frames = _conversation(peer.client)
        if chunk:
            await peer.feed(b"".join(frames), chunk)
        else:
            for frame in frames:
                await peer.feed(frame, len(frame))
        return peer.seen, peer.client_reads()

    seen, answered = asyncio.run(scenario())
    assert [message for _, message in seen] == SENT
    # Taken by the app's taker: whole text frames, the first of them at least (nothing queued before it); the one over
    # 64 KiB is websockets' to unmask, and so reaches the app through ASGI.
    assert ("taken", SENT[0]) in seen and ("received", SENT[4]) in seen
    assert all(kind == "received" for kind, message in seen if not message.startswith(b"take"))
    assert [(f.opcode, f.data) for f in answered] == [(Opcode.PONG, b"are you there")]


def test_frames_that_came_with_the_handshake_and_after_it_are_read_whole() -> None:
    """Bytes after the handshake's request in the same read are websockets' already: half a frame there and its rest
    in the next read still make the message, and the messages after it arrive too."""

    async def scenario() -> list[tuple[str, bytes]]:
        peer = Peer()
        first = _frames(peer.client, Frame(Opcode.TEXT, b"take:1" + b"a" * 200))
        second = _frames(peer.client, Frame(Opcode.TEXT, b"take:2"))
        await peer.open(with_request=first[:5])
        await peer.feed(first[5:] + second, 1000)
        return peer.seen

    assert [message for _, message in asyncio.run(scenario())] == [b"take:1" + b"a" * 200, b"take:2"]


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        ([Frame(Opcode.TEXT, b"take:\xff\xfe")], 1007),  # not UTF-8: the taker leaves it, uvicorn fails the connection
        ([Frame(Opcode.TEXT, b"take:" + b"x" * 2000)], 1009),  # over the server's message limit
        ([Frame(Opcode.CONT, b"take:")], 1002),  # a continuation with no message open
        ([Frame(Opcode.TEXT, b"take:", fin=False), Frame(Opcode.TEXT, b"take:")], 1002),  # a message in a message
    ],
)
def test_a_bad_frame_fails_the_connection_as_websockets_fails_it(frames: list[Frame], code: int) -> None:
    async def scenario() -> tuple[list[tuple[str, bytes]], list[Frame], bool]:
        peer = Peer(max_size=1000)
        await peer.open()
        await peer.feed(_frames(peer.client, Frame(Opcode.TEXT, b"take:ok"), *frames), 1 << 20)
        return peer.seen, peer.client_reads(), peer.transport.closing

    seen, answered, closing = asyncio.run(scenario())
    assert seen == [("taken", b"take:ok")]
    closes = [Close.parse(f.data) for f in answered if f.opcode is Opcode.CLOSE]
    assert [c.code for c in closes] == [code] and closing


def test_a_frame_over_the_limit_fails_the_connection_before_its_payload_arrives() -> None:
    """Its header says how long it is: the server holds none of it (websockets fails it on the header)."""

    async def scenario() -> tuple[list[Frame], bool]:
        peer = Peer(max_size=1000)
        await peer.open()
        # A masked text frame's header declaring 2**40 bytes, and the first few of them.
        await peer.feed(bytes((0x81, 0x80 | 127)) + (1 << 40).to_bytes(8, "big") + b"mask" + b"x" * 100, 1 << 20)
        return peer.client_reads(), peer.transport.closing

    answered, closing = asyncio.run(scenario())
    assert [Close.parse(f.data).code for f in answered if f.opcode is Opcode.CLOSE] == [1009] and closing


def test_the_clients_close_reaches_the_app_after_the_messages_before_it() -> None:
    async def scenario() -> tuple[list[tuple[str, bytes]], int | None]:
        peer = Peer()
        await peer.open()
        data = _frames(peer.client, Frame(Opcode.TEXT, b"take:1"), Frame(Opcode.TEXT, b"keep:2"))
        peer.client.send_close(1000)
        await peer.feed(data + b"".join(peer.client.data_to_send()), 1 << 20)
        await asyncio.wait_for(peer.done.wait(), timeout=5)
        return peer.seen, peer.closed_with

    seen, code = asyncio.run(scenario())
    assert seen == [("taken", b"take:1"), ("received", b"keep:2")] and code == 1000
