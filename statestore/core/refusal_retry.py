"""The one retry a backend's refusal as too long earns (docs/protocol.md §9, "A backend's own refusal"), for both doors:
a refusal recognised in the backend's own words (upstream/refusals.py) teaches the window it states, and a turn the
door can cut is cut, once, and sent again, before anything is stored or any byte reaches the client. A second refusal,
or one the door cannot cut, is handed back as the backend said it, for the door to relay in its own shape."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from statestore.core.windows import Windows
from statestore.upstream.client import UpstreamResponse
from statestore.upstream.refusals import Refusal, recognise

# Cuts the refused turn's context to the window the refusal leaves and rebuilds its body: False when it cannot
# (the policy does not manage the context, or nothing can be cut).
Cut = Callable[[Refusal], Awaitable[bool]]


@dataclass(frozen=True, slots=True)
class Refused:
    """The backend's answer the turn ends with: its status, headers and body, read whole and closed."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


async def send_turn(
    send: Callable[[], Awaitable[UpstreamResponse]],
    accepted: Callable[[int], bool],
    *,
    windows: Windows | None,
    model: str | None,
    cut: Cut,
) -> UpstreamResponse | Refused:
    """The backend's response to the turn (a status the door `accepted`, its body still to read), after at most one
    cut; else the backend's answer as `Refused`."""
    retried = False
    while True:
        response = await send()
        if accepted(response.status):
            return response
        try:
            raw = await response.read()
        finally:
            await response.aclose()
        refusal = recognise(response.status, raw)
        if refusal is not None and windows is not None:
            windows.learn(model, refusal.window_tokens)
        if retried or refusal is None or not await cut(refusal):
            return Refused(response.status, response.headers, raw)
        retried = True
