"""An `auto` context window on the Responses door (docs/protocol.md §9, "context_window_tokens: auto"): the one the Chat
Completions backend states for the turn's model, asked with the deployment's credential in keys mode."""

from __future__ import annotations

from statestore.auth import Principal
from statestore.core import planner
from statestore.policy import Policy
from statestore.responses.backend import backend_headers
from statestore.responses.request import TurnRequest
from statestore.upstream.windows import Windows


async def with_window(windows: Windows | None, policy: Policy, turn: TurnRequest, principal: Principal) -> Policy:
    """The policy with its `auto` window resolved; only a turn that manages its context (`truncation: "auto"`)
    asks. Unknown, the window stays unset and the turn is forwarded as rebuilt."""
    if policy.context_window_tokens != "auto" or turn.truncation != "auto":
        return policy
    discovered = await windows.window(turn.model, backend_headers([], principal)) if windows is not None else None
    return planner.resolved_window(policy, discovered)
