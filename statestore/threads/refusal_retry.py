"""The backend's own word on a threaded turn's window (docs/protocol.md §9): an `auto` window resolved to the one the
backend states ("Windows discovered"), and a turn the backend refused as too long cut to the target and sent once more,
with a managed context, before anything is stored or any byte reaches the client ("Real backends refuse in their own
words"). What the cut needs is kept from the turn's preparation."""

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


async def cut_after_refusal(
    repository: ThreadStore, windows: Windows | None, prepared: PreparedTurn, refusal: Refusal
) -> bool:
    """Remember the window the refusal stated; then, once per turn, cut the refused turn's context to the target of
    the window the refusal leaves (the policy's, narrowed to the stated maximum) and rebuild its body. False when the
    policy does not manage the context, the turn was cut once already, or nothing can be cut."""
    if windows is not None:
        windows.learn(prepared.replay[0], refusal.window_tokens)
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
