"""A backend's refusal of a request as too long for its context window, recognised in its own dialect (docs/protocol.md
§9, "Real backends refuse in their own words"), from the status and the error body, never from a guess: a doorway that
manages the context cuts it and sends once more, and the numbers the refusal states teach the window and the
tokenizer's ratio. Nothing of the body but the dialect and its numbers is kept.

The wording each dialect is recognised by, as the backends' own sources write it:
- Anthropic: 400 `invalid_request_error`, "prompt is too long: N tokens > M maximum".
- OpenAI: `code: context_length_exceeded` ("This model's maximum context length is M tokens. However, your messages
  resulted in N tokens", or, on newer models, with no numbers).
- vLLM: 400 "This model's maximum context length is M tokens. However, your request has N input tokens" (older
  releases: "you requested N tokens"), or "The decoder prompt (length N) is longer than the maximum model length of
  M", in OpenAI's error shape or its older `{"object": "error", ...}`.
- llama.cpp's server: 400 `type: exceed_context_size_error` with `n_prompt_tokens` and `n_ctx` beside the message,
  in OpenAI's error shape on every route (its `/v1/messages` too).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import orjson

Dialect = Literal["anthropic", "openai", "vllm", "llama.cpp"]

# A refusal is a client error; a 5xx or a 429 is something else, however it is worded.
_REFUSING_STATUSES = frozenset({400, 413, 422})
_ANTHROPIC = re.compile(r"prompt is too long: (\d+) tokens > (\d+) maximum")
_MAXIMUM_CONTEXT = re.compile(r"maximum context length is (\d+) tokens")
_REQUESTED = re.compile(
    r"(?:your request has|you requested|your messages resulted in|resulted in) (\d+) (?:input )?tokens"
)
_VLLM_DECODER = re.compile(r"decoder prompt \(length (\d+)\) is longer than the maximum model length of (\d+)")


@dataclass(frozen=True, slots=True)
class Refusal:
    """The backend said the request does not fit its window: who said it, and the numbers it gave (None when it
    gave none)."""

    dialect: Dialect
    prompt_tokens: int | None = None
    window_tokens: int | None = None

    def ratio(self, sent_bytes: int) -> float | None:
        """Tokens per byte of the request the backend counted, when it counted it."""
        if self.prompt_tokens and sent_bytes > 0:
            return self.prompt_tokens / sent_bytes
        return None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _number(match: re.Match[str] | None, group: int) -> int | None:
    return int(match.group(group)) if match is not None else None


def recognise(status: int, body: bytes) -> Refusal | None:
    """The refusal `body` (the backend's error response with `status`) states, or None when it is another error."""
    if status not in _REFUSING_STATUSES or len(body) > 65_536:
        return None
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(parsed, dict):
        return None
    error = parsed.get("error")
    if not isinstance(error, dict):
        # vLLM's older shape puts the error's fields at the top.
        if parsed.get("object") != "error":
            return None
        error = parsed
    message = error.get("message")
    text = message if isinstance(message, str) else ""
    kind = error.get("type")
    if kind == "exceed_context_size_error":
        return Refusal("llama.cpp", _int(error.get("n_prompt_tokens")), _int(error.get("n_ctx")))
    if parsed.get("type") == "error" and kind == "invalid_request_error":
        anthropic = _ANTHROPIC.search(text)
        if anthropic is not None:
            return Refusal("anthropic", int(anthropic.group(1)), int(anthropic.group(2)))
        return None
    maximum = _MAXIMUM_CONTEXT.search(text)
    if error.get("code") == "context_length_exceeded":
        return Refusal("openai", _number(_REQUESTED.search(text), 1), _number(maximum, 1))
    if maximum is not None:
        return Refusal("vllm", _number(_REQUESTED.search(text), 1), int(maximum.group(1)))
    decoder = _VLLM_DECODER.search(text)
    if decoder is not None:
        return Refusal("vllm", int(decoder.group(1)), int(decoder.group(2)))
    return None
