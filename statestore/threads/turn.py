"""Reading a threaded turn out of a parsed request body and headers; only the new turn is looked at (§2, §6)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from statestore.errors import InvalidRequest
from statestore.upstream.client import THREADS_BETA

SESSION_HEADER = b"statestore-session-id"
TTL_HEADER = b"statestore-ttl"
_SESSION_NAME = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_ROLES = frozenset({"user", "assistant", "system"})
_ABSENT: Any = object()


@dataclass(slots=True)
class ThreadTurn:
    mode: Literal["create", "continue", "session"]
    previous_message_id: str | None
    session: str | None
    # Every field of the request except thread, system, tools and messages, in the client's order.
    fields: dict[str, Any]
    system: Any  # _ABSENT when the request has none
    tools: Any
    messages: list[Any]
    stream: bool
    metadata_user_id: str | None
    ttl_header: bytes | None
    anthropic_beta: str

    @property
    def has_system(self) -> bool:
        return self.system is not _ABSENT

    @property
    def has_tools(self) -> bool:
        return self.tools is not _ABSENT


def _header(headers: Iterable[tuple[bytes, bytes]], wanted: bytes) -> bytes | None:
    for name, value in headers:
        if name == wanted:
            return value
    return None


def _has_threads_beta(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    beta = THREADS_BETA.encode()
    return any(
        name == b"anthropic-beta" and any(part.strip() == beta for part in value.split(b",")) for name, value in headers
    )


def read_turn(body: dict[str, Any], headers: list[tuple[bytes, bytes]]) -> ThreadTurn | None:
    """The threaded turn the request asks for, or None for a plain stateless request."""
    thread = body.get("thread", _ABSENT)
    session_value = _header(headers, SESSION_HEADER)
    if thread is _ABSENT and session_value is None:
        return None

    session: str | None = None
    if session_value is not None:
        session = session_value.decode("latin-1")
        if not _SESSION_NAME.fullmatch(session):
            raise InvalidRequest("statestore-session-id must be 1-128 characters of A-Z, a-z, 0-9, '.', '_', ':', '-'")

    mode: Literal["create", "continue", "session"]
    previous: str | None = None
    if thread is _ABSENT:
        mode = "session"
    else:
        if not _has_threads_beta(headers):
            raise InvalidRequest(f"the thread field needs the anthropic-beta header to include {THREADS_BETA}")
        if not isinstance(thread, dict) or thread.get("type") not in ("create", "continue"):
            raise InvalidRequest(
                'thread must be {"type": "create"} or {"type": "continue", "previous_message_id": ...}'
            )
        if thread["type"] == "create":
            if set(thread) != {"type"}:
                raise InvalidRequest('thread of type "create" takes no other field')
            mode = "create"
        else:
            previous = thread.get("previous_message_id")
            if set(thread) != {"type", "previous_message_id"} or not isinstance(previous, str) or not previous:
                raise InvalidRequest('thread of type "continue" needs previous_message_id, a response id string')
            mode = "continue"
            session = None  # the thread field wins over the session header

    messages = body.get("messages", _ABSENT)
    if messages is _ABSENT:
        raise InvalidRequest("messages: field required")
    if not isinstance(messages, list):
        raise InvalidRequest("messages: must be an array")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(f"messages.{index}: must be an object")
        if message.get("role") not in _ROLES:
            raise InvalidRequest(f"messages.{index}.role: must be one of user, assistant, system")
        content = message.get("content", _ABSENT)
        if not isinstance(content, str | list):
            raise InvalidRequest(f"messages.{index}.content: must be a string or an array of content blocks")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest("stream: must be a boolean")
    metadata = body.get("metadata")
    user_id = metadata.get("user_id") if isinstance(metadata, dict) else None

    fields = {k: v for k, v in body.items() if k not in ("thread", "system", "tools", "messages")}
    return ThreadTurn(
        mode=mode,
        previous_message_id=previous,
        session=session,
        fields=fields,
        system=body.get("system", _ABSENT),
        tools=body.get("tools", _ABSENT),
        messages=messages,
        stream=stream,
        metadata_user_id=user_id if isinstance(user_id, str) else None,
        ttl_header=_header(headers, TTL_HEADER),
        anthropic_beta=(_header(headers, b"anthropic-beta") or b"").decode("latin-1"),
    )
