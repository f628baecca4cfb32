"""The Chat Completions call of a Responses turn, and the Responses door's side of the one retry a refusal as too long
earns (docs/protocol.md §9, "A backend's own refusal"; core/refusal_retry.py sends it once more): with
`truncation: "auto"` the turn's context is cut to the target of the window the refusal leaves, before anything is
stored or any event reaches the client; otherwise, or on a second refusal, the backend's error is relayed in OpenAI's
shape."""

from __future__ import annotations

from statestore.auth import Principal
from statestore.core import planner, refusal_retry
from statestore.core.windows import Windows
from statestore.responses.backend import CHAT_PATH, backend_headers, relayed_error
from statestore.responses.context import Summarize
from statestore.responses.prepared import PreparedResponse
from statestore.upstream.client import Upstream, UpstreamResponse
from statestore.upstream.refusals import Refusal


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
    sent = await refusal_retry.send_turn(
        lambda: upstream.send("POST", CHAT_PATH, backend_headers(headers, principal), prepared.backend_body()),
        _is_ok,
        windows=windows,
        model=prepared.turn.model,
        cut=lambda refusal: _cut(prepared, refusal, summarize),
    )
    if isinstance(sent, refusal_retry.Refused):
        raise relayed_error(sent.status, sent.body)
    return sent


def _is_ok(status: int) -> bool:
    return status < 300


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
