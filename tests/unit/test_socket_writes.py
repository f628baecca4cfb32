"""statestore/socket_protocol.py's writes: text messages written directly (the scope's `statestore.websocket.text`
extension) and sent through ASGI leave as one message each, in the order they were sent, in one write per pass of the
event loop; while the transport's buffer is full the direct writer refuses, and a send through ASGI waits."""

from __future__ import annotations

import asyncio
from typing import Any

from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode

from statestore.socket_protocol import TEXT_WRITER
from tests.support.websocket_peer import serve


def _frames(client: ClientProtocol, written: bytes) -> list[bytes]:
    client.receive_data(written)
    return [bytes(e.data) for e in client.events_received() if isinstance(e, Frame) and e.opcode is Opcode.TEXT]


def test_direct_and_asgi_sends_leave_in_order_and_a_full_buffer_refuses_the_direct_writer() -> None:
    async def scenario() -> tuple[list[bytes], list[bool], int]:
        refused: list[bool] = []
        writes_before_resume = 0

        async def app(scope: Any, receive: Any, send: Any) -> None:
            nonlocal writes_before_resume
            await receive()
            await send({"type": "websocket.accept"})
            write = scope["extensions"][TEXT_WRITER]["write"]
            refused.append(not write(b'{"n":1}'))
            await send({"type": "websocket.send", "text": '{"n":2}'})
            refused.append(not write('{"n":3,"t":"caf\u00e9"}'.encode()))
            protocol.pause_writing()  # the transport's buffer is full
            refused.append(not write(b'{"n":4}'))
            waiting = asyncio.ensure_future(send({"type": "websocket.send", "text": '{"n":4}'}))
            await asyncio.sleep(0.01)
            writes_before_resume = len(transport.writes)
            assert not waiting.done()
            protocol.resume_writing()
            await waiting
            refused.append(not write(b'{"n":5}'))
            await asyncio.sleep(0)

        protocol, transport, client = serve(app)
        protocol.data_received(b"".join(client.data_to_send()))
        await asyncio.wait_for(asyncio.gather(*protocol.tasks), timeout=10)
        client.receive_data(transport.writes[0])  # the handshake's answer
        client.events_received()
        messages = _frames(client, b"".join(transport.writes[1:]))
        return messages, refused, writes_before_resume - 1

    messages, refused, writes_before_resume = asyncio.run(scenario())
    assert messages == [b'{"n":1}', b'{"n":2}', '{"n":3,"t":"caf\u00e9"}'.encode(), b'{"n":4}', b'{"n":5}']
    assert refused == [False, False, True, False]
    assert writes_before_resume == 1  # messages 1 to 3 in one write, nothing while the buffer was full


def test_the_direct_writer_refuses_once_the_client_closes_or_leaves() -> None:
    """The writer's one question (open, not closing, the client there) is kept up to date by the protocol's events:
    a close frame from the client, the connection lost."""

    async def scenario() -> list[bool]:
        written: list[bool] = []
        closed = asyncio.Event()

        async def app(scope: Any, receive: Any, send: Any) -> None:
            await receive()
            await send({"type": "websocket.accept"})
            write = scope["extensions"][TEXT_WRITER]["write"]
            written.append(write(b'{"n":1}'))
            await closed.wait()
            written.append(write(b'{"n":2}'))  # the client's close frame arrived
            await receive()
            protocol.connection_lost(None)
            written.append(write(b'{"n":3}'))

        protocol, transport, client = serve(app)
        protocol.data_received(b"".join(client.data_to_send()))
        while not written:
            await asyncio.sleep(0)
        client.receive_data(transport.writes[0])  # the handshake's answer
        client.send_close(1000)
        protocol.data_received(b"".join(client.data_to_send()))
        closed.set()
        await asyncio.wait_for(asyncio.gather(*protocol.tasks), timeout=10)
        return written

    assert asyncio.run(scenario()) == [True, False, False]
