"""Calls to the Chat Completions backend: its headers, and its errors relayed in OpenAI's shape."""

from __future__ import annotations

import orjson

from statestore.auth import Principal
from statestore.responses.chat_format import summary_text
from statestore.responses.context import Summarize
from statestore.responses.errors import BackendError
from statestore.upstream.client import Upstream, UpstreamResponse
from statestore.upstream.side_request import side_reply

CHAT_PATH = "/v1/chat/completions"
_CREDENTIALS = frozenset({b"authorization", b"x-api-key"})


def backend_headers(headers: list[tuple[bytes, bytes]], principal: Principal) -> list[tuple[bytes, bytes]]:
    """keys mode: the configured credential as a bearer token; passthrough: the client's own credential."""
    out = [(b"content-type", b"application/json"), (b"accept-encoding", b"identity")]
    if principal.upstream_credential is not None:
        return [*out, (b"authorization", b"Bearer " + principal.upstream_credential[1])]
    # The first of the two in the request: looked up in a dict built in C, not a loop over every header; a request
    # that sends both (rare) is read in order.
    found = dict(reversed(headers))
    authorization, key = found.get(b"authorization"), found.get(b"x-api-key")
    if (
        authorization is not None
        and key is not None
        and next(n for n, _ in headers if n in _CREDENTIALS) != b"authorization"
    ):
        authorization = None
    if authorization is not None:
        return [*out, (b"authorization", authorization)]
    if key is not None:
        return [*out, (b"authorization", b"Bearer " + key)]
    return out


async def call_backend(
    upstream: Upstream, headers: list[tuple[bytes, bytes]], principal: Principal, body: bytes
) -> UpstreamResponse:
    response = await upstream.send("POST", CHAT_PATH, backend_headers(headers, principal), body)
    if response.status >= 300:
        try:
            raw = await response.read()
        finally:
            await response.aclose()
        raise relayed_error(response.status, raw)
    return response


def relayed_error(status: int, raw: bytes) -> BackendError:
    """The backend's error with its status; its message when it gave one in OpenAI's shape."""
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError:
        parsed = None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        relayed = BackendError(error["message"], status=status, param=error.get("param"), code=error.get("code"))
        if isinstance(error.get("type"), str):
            relayed.error_type = error["type"]  # type: ignore[misc]
        return relayed
    return BackendError(f"the model backend answered {status}", status=status)


def summarizer(upstream: Upstream, headers: list[tuple[bytes, bytes]], principal: Principal) -> Summarize:
    """One turn's summary call (docs/protocol.md §9), with the turn's credential: the reply is read whole, never
    relayed, and any failure is None (the turn then truncates, and says so)."""

    async def summarize(body: bytes) -> str | None:
        reply = await side_reply(upstream, CHAT_PATH, backend_headers(headers, principal), body, purpose="summary")
        return None if reply is None else summary_text(reply)

    return summarize
