"""statestore's WebSocket protocol (statestore/socket_protocol.py) on a transport that records what it writes, with an
ASGI app of the test's, and a websockets client protocol to talk to it: the protocol's reads and writes seen byte for
byte, with no socket between."""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.config import Config
from uvicorn.server import ServerState
from websockets.client import ClientProtocol
from websockets.uri import parse_uri

from statestore.socket_protocol import StatestoreWebSocketProtocol


class Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closing = False

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 8000) if name in ("sockname", "peername") else default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def serve(app: Any, *, max_size: int = 1 << 20) -> tuple[StatestoreWebSocketProtocol, Transport, ClientProtocol]:
    """The protocol serving `app` on a new connection, its transport, and a client whose opening handshake request
    waits in its `data_to_send()`. Call from a running event loop."""
    config = Config(app=app, ws_per_message_deflate=False, ws_ping_interval=None, ws_max_size=max_size, lifespan="off")
    config.load()
    protocol = StatestoreWebSocketProtocol(config, ServerState(), {}, _loop=asyncio.get_running_loop())
    transport = Transport()
    protocol.connection_made(transport)
    client = ClientProtocol(parse_uri("ws://127.0.0.1:8000/v1/responses"), max_size=None)
    client.send_request(client.connect())
    return protocol, transport, client
