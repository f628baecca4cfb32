"""The WebSocket protocol statestore serves with (WebSocket mode on /v1/responses, api/responses_socket.py):
uvicorn's websockets-sansio protocol, except at shutdown. uvicorn closes every open WebSocket at once with 1012;
here the app is asked to drain instead: a connection takes no new response, its running one finishes within the
background grace, then it closes with 1001 (going away), and uvicorn waits for that as it waits for any request."""

from __future__ import annotations

from collections.abc import Callable

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

# What drains the app's WebSockets, registered by the app (one per app in this process); each returns whether it
# will close its connections itself.
DRAINS: list[Callable[[], bool]] = []


def drain() -> bool:
    drains = [each() for each in list(DRAINS)]
    return any(drains)


class StatestoreWebSocketProtocol(WebSocketsSansIOProtocol):
    def shutdown(self) -> None:
        if self.handshake_complete and not self.close_sent and drain():
            return  # the app closes this connection (with 1001) once its running response is done
        super().shutdown()
