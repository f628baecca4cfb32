"""Compaction on the Responses door (docs/responses.md, "Compaction"): what a compacted context holds, the compaction
item that stands for it, and a compaction item a client sends back, opened.

A compacted context is the user messages it had (the newest that fit, when a turn compacts past its threshold; all of
them for `/v1/responses/compact`), then the summary of the whole as one more user message (planner.SUMMARY_PREFIX
opens it). A user message, not a system one: many chat templates refuse a system message anywhere but first. The
summary of an earlier compaction is no user message of its own: it is summarised again, with the rest."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from statestore.core import planner
from statestore.responses.chat_format import CHAT
from statestore.responses.compaction_seal import CompactionSeal
from statestore.responses.errors import BadRequest
from statestore.responses.ids import new_id
from statestore.responses.items import stored
from statestore.sealing import Unsealable
from statestore.store.response_records import StoredItem

CREATED_BY = "statestore"
# How a summary message (CHAT.summary_message) begins: `{"role":"user","content":"Summary of …`.
_SUMMARY_START = orjson.dumps({"role": "user", "content": planner.SUMMARY_PREFIX})[:-2]


def compaction_item(seal: CompactionSeal, summary: str, owner: str) -> dict[str, Any]:
    return {
        "type": "compaction",
        "id": new_id("cmp_"),
        "encrypted_content": seal.seal(summary, owner),
        "created_by": CREATED_BY,
    }


def is_summary(message: bytes) -> bool:
    return message.startswith(_SUMMARY_START)


def user_messages(messages: Sequence[bytes]) -> list[bytes]:
    """The user messages of a context (rendered Chat Completions bytes, one message each), summaries left out."""
    return [m for m in messages if m.startswith(b'{"role":"user",') and not is_summary(m)]


def newest_that_fit(messages: Sequence[bytes], budget_bytes: float) -> list[bytes]:
    """The latest of `messages` whose bytes together stay within `budget_bytes`, in their order."""
    kept: list[bytes] = []
    used = 0
    for message in reversed(messages):
        used += len(message) + 1
        if used > budget_bytes:
            break
        kept.append(message)
    kept.reverse()
    return kept


def compacted_head(users: Sequence[bytes], summary: str) -> bytes:
    """The stored head of a compacted chain: its user messages, then the summary; what every later turn sends first."""
    return b",".join([*users, CHAT.summary_message(summary)])


def user_item(rendered: bytes) -> dict[str, Any]:
    """A rendered user message as the Responses item `/v1/responses/compact` returns for it."""
    content = orjson.loads(rendered)["content"]
    parts = [_text(content)] if isinstance(content, str) else []
    for part in content if isinstance(content, list) else ():
        if part.get("type") == "image_url":
            image = part.get("image_url") or {}
            parts.append({"type": "input_image", "image_url": image.get("url"), "detail": image.get("detail", "auto")})
        else:
            parts.append(_text(str(part.get("text", ""))))
    return {"type": "message", "id": new_id("msg_"), "role": "user", "content": parts, "status": "completed"}


def _text(text: str) -> dict[str, Any]:
    return {"type": "input_text", "text": text}


def unavailable(param: str | None) -> BadRequest:
    return BadRequest(
        "Compaction needs a sealing key: set STATESTORE_COMPACTION_KEYS (or STATESTORE_OWNER_SECRET).",
        param=param,
        code="compaction_unavailable",
    )


def stored_inputs(items: Sequence[dict[str, Any]], seal: CompactionSeal | None, owner: str) -> list[StoredItem]:
    """A turn's input items as stored: a compaction item is rendered as its summary, opened for `owner`; one that does
    not open (tampered with, another owner's, under a key this server no longer holds) is the request's fault."""
    out: list[StoredItem] = []
    for item in items:
        if item["type"] != "compaction":
            out.append(stored(item))
            continue
        if seal is None:
            raise unavailable("input")
        try:
            summary = seal.open(item["encrypted_content"], owner)
        except Unsealable:
            raise BadRequest(
                "Invalid 'input': a compaction item's encrypted_content could not be opened.",
                param="input",
                code="invalid_encrypted_content",
            ) from None
        out.append(
            StoredItem(
                item_id=str(item["id"]),
                body=orjson.dumps(item),
                kind="message",
                rendered=CHAT.summary_message(summary),
            )
        )
    return out
