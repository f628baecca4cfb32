"""A request to the model backend beside a turn (a summary, docs/protocol.md §9): its reply read whole, never relayed,
and any failure an absent answer, so the turn goes on without it."""

from __future__ import annotations

import logging
from typing import Any

import orjson

from statestore.upstream.client import Upstream

log = logging.getLogger(__name__)


async def side_reply(
    upstream: Upstream, path: str, headers: list[tuple[bytes, bytes]], body: bytes, *, purpose: str
) -> Any:
    """The backend's JSON reply to a POST of `body`, or None when the request failed, was refused or is not JSON.
    `purpose` names the request in the logs (never its content)."""
    try:
        response = await upstream.send("POST", path, headers, body)
        try:
            raw = await response.read()
        finally:
            await response.aclose()
    except Exception as exc:  # the turn goes on without it, whatever went wrong
        log.warning("%s request failed", purpose, extra={"error": type(exc).__name__})
        return None
    if response.status != 200:
        log.warning("%s request refused", purpose, extra={"status": response.status})
        return None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
