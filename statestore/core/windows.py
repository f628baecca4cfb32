"""Context windows discovered from the backend (docs/protocol.md §9, "context_window_tokens: auto"), for a policy whose
`context_window_tokens` is `auto`, and that policy resolved for a turn, on both doors: the model's entry in
`GET /v1/models` (vLLM's `max_model_len`, llama.cpp's `meta.n_ctx`), else llama.cpp's `GET /props`
(`default_generation_settings.n_ctx`, the runtime window of a slot, not the model's trained length), else the maximum
a refusal stated. Per model, refreshed now and then; a model whose window is unknown stays unknown (its turns are
forwarded as rebuilt) until one of those says it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from statestore.core import planner
from statestore.policy import Policy
from statestore.upstream.client import Upstream

log = logging.getLogger(__name__)

# How long a discovered window is believed, and how long a backend that told nothing is left alone before it is asked
# again (a restart with another -c, another model behind the same name).
REFRESH_SECONDS = 300.0
RETRY_SECONDS = 30.0
_MAX_BODY = 1 << 20


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def window_in_models(body: Any, model: str | None) -> int | None:
    """The window `GET /v1/models` states for `model` (the only entry, when the server names one model)."""
    entries = body.get("data") if isinstance(body, dict) else None
    if not isinstance(entries, list):
        return None
    listed = [entry for entry in entries if isinstance(entry, dict)]
    chosen = [entry for entry in listed if entry.get("id") == model] or (listed if len(listed) == 1 else [])
    for entry in chosen:
        meta = entry.get("meta")
        found = _positive(entry.get("max_model_len")) or (
            _positive(meta.get("n_ctx")) if isinstance(meta, dict) else None
        )
        if found is not None:
            return found
    return None


def window_in_props(body: Any) -> int | None:
    """The runtime window llama.cpp's `GET /props` states (a slot's, which is what one request gets)."""
    settings = body.get("default_generation_settings") if isinstance(body, dict) else None
    return _positive(settings.get("n_ctx")) if isinstance(settings, dict) else None


class Windows:
    """What one backend said of its models' windows."""

    def __init__(self, upstream: Upstream, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._upstream = upstream
        self._clock = clock
        self._known: dict[str | None, tuple[int | None, float]] = {}  # model -> (tokens, believed until)
        self._lock = asyncio.Lock()

    def learn(self, model: str | None, tokens: int | None) -> None:
        """A refusal stated the window: believed until the next refresh."""
        if tokens is not None and tokens > 0:
            self._known[model] = (tokens, self._clock() + REFRESH_SECONDS)

    async def window(self, model: str | None, headers: list[tuple[bytes, bytes]]) -> int | None:
        """The model's window in tokens, or None while it is unknown. `headers`: the credential to ask with."""
        known = self._known.get(model)
        if known is not None and known[1] > self._clock():
            return known[0]
        async with self._lock:  # one discovery at a time; the turns that waited read its result
            known = self._known.get(model)
            if known is not None and known[1] > self._clock():
                return known[0]
            tokens = await self._discover(model, headers)
            if tokens is None and known is not None:
                tokens = known[0]  # keep what a refusal taught while the backend says nothing
            self._known[model] = (tokens, self._clock() + (REFRESH_SECONDS if tokens else RETRY_SECONDS))
            return tokens

    async def _discover(self, model: str | None, headers: list[tuple[bytes, bytes]]) -> int | None:
        models = await self._get("/v1/models", headers)
        found = window_in_models(models, model)
        if found is None:
            found = window_in_props(await self._get("/props", headers))
        return found

    async def _get(self, path: str, headers: list[tuple[bytes, bytes]]) -> Any:
        try:
            response = await self._upstream.send("GET", path, headers, b"")
            try:
                raw = await response.read() if response.status == 200 else b""
            finally:
                await response.aclose()
        except Exception as exc:  # discovery is best effort: the turn goes on as if the window were unknown
            log.info("window discovery failed", extra={"path": path, "error": type(exc).__name__})
            return None
        if not raw or len(raw) > _MAX_BODY:
            return None
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None


async def resolved(
    windows: Windows | None,
    policy: Policy,
    model: str | None,
    asking: Callable[[], Sequence[tuple[bytes, bytes]]],
) -> Policy:
    """The policy with its `auto` window replaced by the one the backend states for `model` (None while unknown: the
    turn is then forwarded as rebuilt). `asking`: the door's headers to ask with (the credential it sends the backend
    the turn with), built only when a window is asked for. The door decides whether its turn manages its context."""
    if policy.context_window_tokens != "auto":
        return policy
    discovered = await windows.window(model, list(asking())) if windows is not None else None
    return planner.resolved_window(policy, discovered)
