"""The client side of `make bench-link`, run inside the shaped network namespace (bench/link.py starts it there):
streamed turns over the link, each on a fresh connection (the link's cost is the point), one JSON line per turn.

    python -m bench.link_client --url URL --turns FILE [--previous RESPONSE_ID]

FILE holds one JSON object per line: {"path", "headers", "body", "chain"}; with `chain`, the body's
`thread.previous_message_id` is set to the id of the reply before it (a threaded continue), else sent as it is.
"""

from __future__ import annotations

import argparse
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson

# The first message id of the stream is message_start's, the one statestore minted (a backend's key order varies).
_MESSAGE_ID = re.compile(rb'"id":"(msg_[A-Za-z0-9]+)"')


def timed_post(url: str, path: str, headers: dict[str, str], body: bytes) -> tuple[dict[str, Any], str | None]:
    """(seconds to the first text delta and to the last byte, bytes sent and received, status; the reply's id)."""
    parts = urlsplit(url)
    head = [f"POST {path} HTTP/1.1", f"host: {parts.netloc}", f"content-length: {len(body)}", "connection: close"]
    head += [f"{name}: {value}" for name, value in headers.items()]
    request = ("\r\n".join(head) + "\r\n\r\n").encode() + body
    started = time.perf_counter()
    received = bytearray()
    first_token: float | None = None
    with socket.create_connection((parts.hostname, parts.port or 80), timeout=600) as sock:
        sock.sendall(request)
        while chunk := sock.recv(1 << 16):
            received += chunk
            if first_token is None and b"content_block_delta" in received:
                first_token = time.perf_counter()
    ended = time.perf_counter()
    status = int(received.split(b" ", 2)[1]) if received.startswith(b"HTTP/1.1 ") else 0
    found = _MESSAGE_ID.search(received)
    result: dict[str, Any] = {
        "status": status,
        "ttft": (first_token or ended) - started,
        "total": ended - started,
        "sent_bytes": len(request),
        "received_bytes": len(received),
    }
    if status != 200:
        result["error"] = bytes(received[-400:]).decode(errors="replace")
    return result, found.group(1).decode() if found else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--turns", type=Path, required=True)
    parser.add_argument("--previous", help="the response id the first chained turn continues")
    args = parser.parse_args()
    previous: str | None = args.previous
    for line in args.turns.read_bytes().splitlines():
        turn = orjson.loads(line)
        body = turn["body"]
        if turn.get("chain"):
            if previous is None:
                raise SystemExit("a chained turn before any reply")
            body["thread"] = {"type": "continue", "previous_message_id": previous}
        result, reply_id = timed_post(args.url, turn["path"], turn["headers"], orjson.dumps(body))
        if turn.get("chain"):
            previous = reply_id
        if result["status"] != 200:
            raise SystemExit(f"turn answered {result['status']}: {result.get('error')}")
        sys.stdout.write(orjson.dumps(result).decode() + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
