"""The summary request of PROTOCOL §9: the turn service asks the backend through this interface, out of band, while
it holds the thread's lease (threads/service.py keeps it renewed), so a slow summary cannot lose the head."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Protocol

import orjson

from statestore.threads import context
from statestore.threads.context_step import Summarize
from statestore.upstream.client import Upstream, request_headers_for_upstream

log = logging.getLogger(__name__)


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
        try:
            response = await self._upstream.send("POST", "/v1/messages", upstream_headers, body)
            try:
                reply = await response.read()
            finally:
                await response.aclose()
        except Exception as exc:  # the turn goes on without a summary, whatever went wrong
            log.warning("summary request failed", extra={"error": type(exc).__name__})
            return None
        if response.status != 200:
            log.warning("summary request refused", extra={"status": response.status})
            return None
        try:
            return context.summary_text(orjson.loads(reply))
        except orjson.JSONDecodeError:
            return None
