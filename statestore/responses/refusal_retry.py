"""The Chat Completions call of a Responses turn, and the one retry a refusal as too long earns (docs/protocol.md §9, "A
backend's own refusal"): with `truncation: "auto"` the turn's context is cut to the target of the window
the refusal leaves and sent once more, before anything is stored or any event reaches the client; otherwise, or on a
second refusal, the backend's error is relayed."""

from __future__ import annotations

from statestore.auth import Principal
from statestore.core import planner
from statestore.core.windows import Windows
from statestore.responses.backend import CHAT_PATH, backend_headers, relayed_error
from statestore.responses.context import Summarize
from statestore.responses.prepared import PreparedResponse
from statestore.upstream.client import Upstream, UpstreamResponse
from statestore.upstream.refusals import Refusal, recognise


async def send_turn(
    upstream: Upstream,
    headers: list[tuple[bytes, bytes]],
    principal: Principal,
    prepared: PreparedResponse,
    *,
    summarize: Summarize | None,
    windows: Windows | None,
) -> UpstreamResponse:
    """The backend's response to the turn (status below 300), after at most one cut; else its error, relayed."""
    retried = False
    while True:
        response = await upstream.send("POST", CHAT_PATH, backend_headers(headers, principal), prepared.backend_body())
        if response.status < 300:
            return response
        try:
            raw = await response.read()
        finally:
            await response.aclose()
        refusal = recognise(response.status, raw)
        if refusal is not None and windows is not None:
            windows.learn(prepared.turn.model, refusal.window_tokens)
        if retried or refusal is None or not await _cut(prepared, refusal, summarize):
            raise relayed_error(response.status, raw)
        retried = True


async def _cut(prepared: PreparedResponse, refusal: Refusal, summarize: Summarize | None) -> bool:
    policy = prepared.policy
    # A compacted turn's context is the one its compaction item stands for: not cut again behind that item's back.
    if policy is None or prepared.turn.truncation != "auto" or prepared.compaction is not None:
        return False
    # As window_for chooses: the owner's strategy, truncate for `none` and on a conversation; with the window the
    # refusal leaves (the policy's own may be unknown, `auto`, or too large).
    chosen = policy.context_strategy
    if chosen == "none" or prepared.turn.conversation_id is not None:
        chosen = "truncate"
    window = planner.window_after_refusal(policy, prepared.window, refusal.window_tokens, chosen)
    if window is None:
        return False
    before = prepared.moved
    await prepared.plan_context(summarize, forced=window, ratio=refusal.ratio(prepared.sent_bytes))
    return prepared.moved is not None and prepared.moved != before
