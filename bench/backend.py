"""The fake model backend of the benchmark: statestore's echo backend, with the delay chosen per request.

`bench-delay-ms: N` on a request (statestore and the relay pass it through like any other header) makes the echo
wait N ms before a JSON reply, or spread N ms over a stream's events; without it there is no delay. One process
then serves the latency phases (no delay) and the throughput phases (50 ms, many turns in flight) alike.

    python -m bench.backend --port 8090 [--reply-bytes N]
"""

from __future__ import annotations

import argparse

from starlette.types import Receive, Scope, Send

from statestore.upstream.echo import EchoApp, serve_asgi

DELAY_HEADER = b"bench-delay-ms"


class DelayByHeader:
    def __init__(self, *, reply_bytes: int | None) -> None:
        self._reply_bytes = reply_bytes
        self._apps: dict[int, EchoApp] = {}

    def _app(self, delay_ms: int) -> EchoApp:
        app = self._apps.get(delay_ms)
        if app is None:
            app = self._apps[delay_ms] = EchoApp(delay_seconds=delay_ms / 1000, reply_bytes=self._reply_bytes)
        return app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        delay_ms = 0
        if scope["type"] == "http":
            for name, value in scope["headers"]:
                if name == DELAY_HEADER:
                    delay_ms = int(value)
                    break
        await self._app(delay_ms)(scope, receive, send)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.backend", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--reply-bytes", type=int, default=None)
    args = parser.parse_args()
    serve_asgi(DelayByHeader(reply_bytes=args.reply_bytes), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
