"""Reading a threaded turn out of a parsed request body and headers; only the new turn is looked at (§2, §6)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from statestore.core.idempotency import KEY_HEADER
from statestore.errors import InvalidRequest
from statestore.upstream.client import THREADS_BETA

SESSION_HEADER = b"statestore-session-id"
TTL_HEADER = b"statestore-ttl"
_SESSION_NAME = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_ROLES = frozenset({"user", "assistant", "system"})
_ABSENT: Any = object()
MAX_USER_ID = 256


def _is_list_of_objects(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, dict) for item in value)


def _is_storable_text(text: str, limit: int) -> bool:
    # PostgreSQL text cannot hold NUL.
    return len(text) <= limit and "\x00" not in text


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
    # The `Idempotency-Key` header as sent (docs/protocol.md §11), read with the others in one lookup.
    idempotency_key: bytes | None = None

    @property
    def has_system(self) -> bool:
        return self.system is not _ABSENT

    @property
    def has_tools(self) -> bool:
        return self.tools is not _ABSENT


_THREADS_BETA = THREADS_BETA.encode()


def _has_threads_beta(first_beta: bytes | None, headers: Iterable[tuple[bytes, bytes]]) -> bool:
    if first_beta == _THREADS_BETA:  # what the SDKs send: no scan
        return True
    # A substring test first: most requests name no beta or only this one, and then no split is needed.
    return any(
        name == b"anthropic-beta"
        and _THREADS_BETA in value
        and (value == _THREADS_BETA or any(part.strip() == _THREADS_BETA for part in value.split(b",")))
        for name, value in headers
    )


def read_turn(body: dict[str, Any], headers: list[tuple[bytes, bytes]]) -> ThreadTurn | None:
    """The threaded turn the request asks for, or None for a plain stateless request."""
    thread = body.get("thread", _ABSENT)
    if thread is None:  # the SDKs type the field as nullable: null means no thread (docs/protocol.md §2)
        thread = _ABSENT
    # The headers looked up once, in C; the first of a repeated header wins.
    named = dict(reversed(headers))
    session_value = named.get(SESSION_HEADER)
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
        if not _has_threads_beta(named.get(b"anthropic-beta"), headers):
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
    system = body.get("system", _ABSENT)
    if system is not _ABSENT and not (isinstance(system, str) or _is_list_of_objects(system)):
        raise InvalidRequest("system: must be a string or an array of content blocks")
    tools = body.get("tools", _ABSENT)
    if tools is not _ABSENT and not _is_list_of_objects(tools):
        raise InvalidRequest("tools: must be an array of tool objects")
    output_config = body.get("output_config")
    if output_config is not None and not isinstance(output_config, dict):
        raise InvalidRequest("output_config: must be an object")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise InvalidRequest("metadata: must be an object")
    user_id = metadata.get("user_id") if metadata is not None else None
    if user_id is not None and not (isinstance(user_id, str) and _is_storable_text(user_id, MAX_USER_ID)):
        raise InvalidRequest(f"metadata.user_id: must be a string of at most {MAX_USER_ID} characters, without NUL")

    fields = {k: v for k, v in body.items() if k not in ("thread", "system", "tools", "messages")}
    return ThreadTurn(
        mode=mode,
        previous_message_id=previous,
        session=session,
        fields=fields,
        system=system,
        tools=tools,
        messages=messages,
        stream=stream,
        metadata_user_id=user_id,
        ttl_header=named.get(TTL_HEADER),
        anthropic_beta=(named.get(b"anthropic-beta") or b"").decode("latin-1"),
        idempotency_key=named.get(KEY_HEADER),
    )
