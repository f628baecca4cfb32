"""Cache diagnostics through statestore (docs/protocol.md §10): `diagnostics.previous_message_id` names a reply the
backend served. An id statestore minted means nothing to the backend, so it is swapped for the backend's own id of that
reply (same owner only) before forwarding; any other id goes through as it came."""

from __future__ import annotations

from typing import Any, Protocol

from statestore.threads.ids import thread_of_response


class BackendIds(Protocol):
    async def backend_id_of(self, *, owner: str, thread_id: str, response_id: str, now_ms: int) -> str | None: ...


def minted_previous_id(fields: dict[str, Any]) -> str | None:
    """The request's `diagnostics.previous_message_id` when it is an id statestore minted, else None."""
    diagnostics = fields.get("diagnostics")
    if not isinstance(diagnostics, dict):
        return None
    previous = diagnostics.get("previous_message_id")
    if not isinstance(previous, str) or thread_of_response(previous) is None:
        return None
    return previous


async def rewrite_previous_id(fields: dict[str, Any], *, owner: str, store: BackendIds, now_ms: int) -> bool:
    """Swap a minted `diagnostics.previous_message_id` in `fields` for the backend's id of that reply. True when
    `fields` changed. The diagnostics object is copied, never changed in place."""
    previous = minted_previous_id(fields)
    if previous is None:
        return False
    thread_id = thread_of_response(previous)
    assert thread_id is not None
    backend_id = await store.backend_id_of(owner=owner, thread_id=thread_id, response_id=previous, now_ms=now_ms)
    if backend_id is None:
        return False
    fields["diagnostics"] = {**fields["diagnostics"], "previous_message_id": backend_id}
    return True


MAX_BACKEND_ID = 200


def storable_backend_id(value: object) -> str | None:
    """The backend's id of a reply if it can be kept (a backend may send none, or something odd)."""
    if isinstance(value, str) and 0 < len(value) <= MAX_BACKEND_ID and "\x00" not in value:
        return value
    return None
