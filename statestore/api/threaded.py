"""The HTTP side of a threaded turn: forward the rebuilt request, and relay the reply (JSON or SSE) so that the turn
is committed before the client can see its end (docs/protocol.md §2): the JSON body after the commit, a stream's
`message_stop` after it. Any failure gives the head back."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import orjson
from starlette.responses import Response

from statestore.api.responses import bytes_response, streaming_response
from statestore.auth import Principal
from statestore.core import refusal_retry
from statestore.errors import StatestoreError, StreamBrokenOff
from statestore.threads import assembly, context, rules
from statestore.threads.diagnostics import storable_backend_id
from statestore.threads.prepared import CompletedReply, PreparedTurn
from statestore.threads.refusal_retry import cut_after_refusal
from statestore.threads.service import ThreadService
from statestore.threads.turn import ThreadTurn
from statestore.threads.usage import usage_of
from statestore.upstream.client import (
    StreamInterrupted,
    Upstream,
    UpstreamResponse,
    request_headers_for_upstream,
    response_headers_for_client,
)
from statestore.upstream.reply_capture import ReplyAccumulator
from statestore.upstream.sse import SSEParser


def _is_ok(status: int) -> bool:
    """A backend's answer the Messages door relays as a reply (anything else is relayed as the backend's error)."""
    return status == 200


def completed(message: dict[str, Any], backend_id: object) -> CompletedReply:
    content = message.get("content", [])
    return CompletedReply(
        row=assembly.stored_reply(content),
        backend_id=storable_backend_id(backend_id),
        usage=usage_of(message),
        compaction=context.compaction_head(content),
    )


async def serve_threaded_turn(
    service: ThreadService,
    upstream: Upstream,
    *,
    turn: ThreadTurn,
    principal: Principal,
    headers: list[tuple[bytes, bytes]],
    query: str,
    response_id: str | None = None,
    begun: Callable[[str, str | None], Awaitable[None]] | None = None,
) -> Response:
    """`response_id`: the reply's id an Idempotency-Key's claim named; `begun`: told the reply's id and the user whose
    data the thread is once the head is taken, before the turn is forwarded (a keyed turn names them under its key,
    api/threaded_keyed.py)."""
    return await _ThreadedTurn(service, upstream).serve(
        turn, principal, headers, query, response_id=response_id, begun=begun
    )


class _ThreadedTurn:
    __slots__ = ("service", "upstream")

    def __init__(self, service: ThreadService, upstream: Upstream) -> None:
        self.service = service
        self.upstream = upstream

    async def serve(
        self,
        turn: ThreadTurn,
        principal: Principal,
        headers: list[tuple[bytes, bytes]],
        query: str,
        *,
        response_id: str | None,
        begun: Callable[[str, str | None], Awaitable[None]] | None,
    ) -> Response:
        prepared = await self.service.begin(turn, principal, headers, response_id=response_id)
        try:
            if begun is not None:
                await begun(prepared.response_id, prepared.scope_user_id)
            return await self._forward(prepared, principal, headers, query)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.service.give_back(prepared)
            raise

    async def _forward(
        self, prepared: PreparedTurn, principal: Principal, headers: list[tuple[bytes, bytes]], query: str
    ) -> Response:
        upstream_headers = request_headers_for_upstream(
            headers, threaded=True, credential=principal.upstream_credential
        )
        path = "/v1/messages" + (f"?{query}" if query else "")
        # A refusal as too long, on a managed context, is cut and sent once more: nothing has reached the client.
        sent = await refusal_retry.send_turn(
            lambda: self.upstream.send("POST", path, upstream_headers, prepared.upstream_body),
            _is_ok,
            windows=self.service.windows,
            model=prepared.replay[0],
            cut=lambda refusal: cut_after_refusal(self.service.repository, prepared, refusal),
        )
        if isinstance(sent, refusal_retry.Refused):
            await self.service.give_back(prepared)
            return bytes_response(sent.status, sent.body, response_headers_for_client(sent.headers, keep_length=False))
        response = sent
        content_type = response.header(b"content-type") or b""
        if not content_type.startswith(b"text/event-stream"):
            try:
                body = await response.read()
            finally:
                await response.aclose()
            return await self._complete_json(prepared, response.headers, body)

        async def settle() -> None:
            await response.aclose()
            await self.service.give_back(prepared)  # a no-op once the turn is stored or given back

        return streaming_response(
            200,
            self._relay_stream(prepared, response),
            response_headers_for_client(response.headers, keep_length=False) + prepared.headers(),
            on_close=settle,
        )

    async def _complete_json(
        self, prepared: PreparedTurn, upstream_headers: list[tuple[bytes, bytes]], body: bytes
    ) -> Response:
        try:
            message = orjson.loads(body)
        except orjson.JSONDecodeError:
            message = None
        headers = response_headers_for_client(upstream_headers, keep_length=False)
        if not isinstance(message, dict) or message.get("type") != "message":
            # Not a Message: relay it as it came, store nothing.
            await self.service.give_back(prepared)
            return bytes_response(200, body, headers)
        backend_id = message.get("id")
        message["id"] = prepared.response_id
        if rules.storable(message):
            await self.service.commit(prepared, completed(message, backend_id))
            headers += prepared.headers()
        else:
            # Returned but not stored: no thread to name (a create's row is gone; a continue's head did not move).
            await self.service.give_back(prepared)
        return bytes_response(200, orjson.dumps(message), headers)

    async def _relay_stream(self, prepared: PreparedTurn, response: UpstreamResponse) -> AsyncIterator[bytes]:
        parser = SSEParser()
        capture = ReplyAccumulator(
            prepared.response_id, anthropic_beta=prepared.anthropic_beta, model=prepared.replay[0] or ""
        )
        try:
            async for chunk in response.chunks():
                out: list[bytes] = []
                for event in parser.feed(chunk):
                    if event.event == "message_stop":
                        # The end of the reply leaves only after the turn is durable.
                        refused = await self._settle_at_the_end(prepared, capture)
                        if refused is not None:
                            # What came before the end still reaches the client, which keeps the reply it saw as
                            # partial (the SDK replays it so); only message_stop is withheld.
                            if out:
                                yield b"".join(out)
                            raise refused
                    out.append(capture.add(event))
                if out:
                    yield b"".join(out)
        except StreamInterrupted as exc:
            raise StreamBrokenOff(f"the backend stream broke off ({type(exc).__name__}); nothing stored") from exc
        except StatestoreError as exc:
            raise StreamBrokenOff(f"the turn was not committed ({type(exc).__name__}); message_stop withheld") from exc
        finally:
            with anyio.CancelScope(shield=True):
                await response.aclose()
                await self.service.give_back(prepared)  # a no-op once the turn is stored

    async def _settle_at_the_end(self, prepared: PreparedTurn, capture: ReplyAccumulator) -> StatestoreError | None:
        """Commit the captured reply (or give the head back if it is not to be stored); the refusal when the commit
        cannot be made (the database, or the lease lost), so the relay can cut the stream after what it holds."""
        with anyio.CancelScope(shield=True):
            try:
                if capture.captured and rules.storable(capture.message):
                    await self.service.commit(prepared, completed(capture.message, capture.backend_id))
                else:
                    await self.service.give_back(prepared)
            except StatestoreError as exc:
                return exc
        return None
