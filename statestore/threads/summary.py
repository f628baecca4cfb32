"""The summary request of docs/protocol.md §9: the turn service asks the backend through this interface, out of band,
while it holds the thread's lease (threads/service.py keeps it renewed), so a slow summary cannot lose the head."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from statestore.threads import context
from statestore.threads.context_step import Summarize
from statestore.upstream.client import Upstream, request_headers_for_upstream
from statestore.upstream.side_request import side_reply


class Summaries(Protocol):
    async def summarize(
        self, body: bytes, *, headers: Iterable[tuple[bytes, bytes]], credential: tuple[bytes, bytes] | None
    ) -> str | None:
        """The summary's text for a summary request body, sent with the turn's own headers and credential; None when
        the request failed in any way (the turn then falls back to truncating)."""
        ...


def summarizer(
    summaries: Summaries | None, headers: Iterable[tuple[bytes, bytes]], credential: tuple[bytes, bytes] | None
) -> Summarize | None:
    """One turn's summary call, for the context step: with the turn's headers and credential bound."""
    if summaries is None:
        return None

    async def summarize(body: bytes) -> str | None:
        return await summaries.summarize(body, headers=headers, credential=credential)

    return summarize


class BackendSummaries:
    """Summaries from the model backend: the reply is read whole and never relayed."""

    __slots__ = ("_upstream",)

    def __init__(self, upstream: Upstream) -> None:
        self._upstream = upstream

    async def summarize(
        self, body: bytes, *, headers: Iterable[tuple[bytes, bytes]], credential: tuple[bytes, bytes] | None
    ) -> str | None:
        upstream_headers = [
            (name, value)
            for name, value in request_headers_for_upstream(headers, threaded=True, credential=credential)
            if name != b"accept"  # a summary is read whole, never streamed
        ]
        reply = await side_reply(self._upstream, "/v1/messages", upstream_headers, body, purpose="summary")
        return None if reply is None else context.summary_text(reply)
