"""The Messages door's side of the backend's own word on a turn's window (docs/protocol.md §9): whether a thread's turn
asks for an `auto` window, and with which credential (core/windows.py resolves it), and how a turn the backend refused
as too long is cut to the target, with a managed context (core/refusal_retry.py sends it once more). What the cut
needs is kept from the turn's preparation."""

from __future__ import annotations

from collections.abc import Iterable

from statestore.auth import Principal
from statestore.core import planner
from statestore.core import windows as windows_of_backend
from statestore.core.windows import Windows
from statestore.policy import Policy
from statestore.store.thread_store import ThreadStore
from statestore.threads import assembly, context_step
from statestore.threads.prepared import PreparedTurn
from statestore.threads.turn import ThreadTurn
from statestore.upstream.client import request_headers_for_upstream
from statestore.upstream.refusals import Refusal


def model_of(turn: ThreadTurn) -> str | None:
    model = turn.fields.get("model")
    return model if isinstance(model, str) else None


async def with_window(
    windows: Windows | None,
    policy: Policy,
    turn: ThreadTurn,
    headers: Iterable[tuple[bytes, bytes]],
    principal: Principal,
) -> Policy:
    """The policy with its `auto` window replaced by the one the backend states for the turn's model (None while
    unknown: the turn is then forwarded as rebuilt)."""
    if policy.context_strategy == "none":
        return policy
    return await windows_of_backend.resolved(
        windows,
        policy,
        model_of(turn),
        lambda: request_headers_for_upstream(headers, threaded=True, credential=principal.upstream_credential),
    )


async def cut_after_refusal(repository: ThreadStore, prepared: PreparedTurn, refusal: Refusal) -> bool:
    """Once per turn, cut the refused turn's context to the target of the window the refusal leaves (the policy's,
    narrowed to the stated maximum) and rebuild its body. False when the policy does not manage the context, the turn
    was cut once already, or nothing can be cut."""
    basis, prepared.recut = prepared.recut, None
    if basis is None:
        return False
    window = planner.window_after_refusal(basis.policy, planner.window_of(basis.policy), refusal.window_tokens)
    if window is None:
        return False
    moved = await context_step.step(
        repository,
        basis.leased,
        basis.turn,
        basis.policy,
        basis.forwarded,
        summarize=basis.summarize,
        forced=window,
        ratio=refusal.ratio(len(prepared.upstream_body)),
    )
    if moved is None:
        return False
    prepared.moved = moved
    prepared.upstream_body = assembly.build_body(
        basis.turn.fields,
        system=basis.leased.system,
        tools=basis.leased.tools,
        history=moved.joined,
        new_messages=basis.forwarded,
    )
    return True
