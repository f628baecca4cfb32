"""Counting a request's prompt with the backend's own tokenizer, without running the model (docs/protocol.md §11,
docs/responses.md). What a backend offers for it is learned from its first count and remembered, so later counts do not
probe again.

Chat Completions backends (the Responses door), asked with the chat request a turn would send:
  * vLLM: `POST /tokenize` takes the request's `model`, `messages` and `tools`, applies the model's chat template and
    answers `{"count": N, "max_model_len": ..., "tokens": [...]}`.
  * llama.cpp's llama-server: `POST /tokenize` takes only text (`{"content": ...}`, answering `{"tokens": [...]}`; a
    body without `content` gets `{"tokens": []}`), so the prompt is first rendered by `POST /apply-template` (the chat
    request as `/v1/chat/completions` takes it, answered `{"prompt": ...}`) and then tokenized with the special
    tokens its own completion adds (`add_special`, `parse_special`): the count is the turn's `prompt_tokens`.
  * any other (SGLang's `/tokenize` takes text only, without the chat template; OpenAI's API has none): no tokenizer,
    and statestore's estimator counts.
Messages backends (the Messages door): `POST /v1/messages/count_tokens` with the request a turn would send; its answer
is relayed as it came (a count, or the backend's refusal). A backend without that route has no counter.

A backend found without one is asked again after a while (a restart may bring one); one that lost the route it had is
probed again on its next count."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

import orjson

from statestore.records import record
from statestore.upstream.client import Upstream

log = logging.getLogger(__name__)

RETRY_SECONDS = 300.0
TOKENIZE = "/tokenize"
APPLY_TEMPLATE = "/apply-template"
# The statuses of a route a server does not serve.
_NO_ROUTE = frozenset({404, 405, 501})
# Statuses that say the request (or its credential) was refused, not that the server lacks a tokenizer: not remembered.
_NOT_LEARNED = frozenset({401, 403, 408, 429})
ChatDialect = Literal["chat", "template", "none"]


@record
class _Answer:
    status: int
    body: Any  # the parsed JSON, or None


@record
class CountReply:
    """A Messages backend's answer to `count_tokens`, as it came."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


async def _post(upstream: Upstream, path: str, headers: list[tuple[bytes, bytes]], body: bytes) -> _Answer | None:
    """The backend's answer, parsed; None when none came (unreachable, timed out, broken off)."""
    try:
        response = await upstream.send("POST", path, headers, body)
        try:
            raw = await response.read()
        finally:
            await response.aclose()
    except Exception as exc:  # a count goes on with the estimate, whatever went wrong
        log.warning("token count request failed", extra={"path": path, "error": type(exc).__name__})
        return None
    try:
        parsed = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError:
        parsed = None
    return _Answer(response.status, parsed)


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _field(body: Any, name: str) -> Any:
    return body.get(name) if isinstance(body, dict) else None


def _names_a_model(body: Any) -> bool:
    """An error about the request's model (vLLM's 404 "The model `x` does not exist."), not about the route."""
    error = _field(body, "error")
    message = _field(error, "message") if isinstance(error, dict) else _field(body, "message")
    return isinstance(message, str) and "model" in message.lower()


def _lacks_route(answer: _Answer) -> bool:
    return answer.status in _NO_ROUTE and not _names_a_model(answer.body)


def chat_tokenize_body(request: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's chat tokenize request for a chat request: the prompt a completion of it would read."""
    body = {name: request[name] for name in ("model", "messages", "tools") if name in request}
    return {**body, "add_generation_prompt": True}


def template_body(request: Mapping[str, Any]) -> dict[str, Any]:
    """llama.cpp's `/apply-template` request: the chat request as its completion reads it (not streamed)."""
    return {name: value for name, value in request.items() if name not in ("stream", "stream_options")}


class ChatTokenizer:
    """What one Chat Completions backend offers to count a prompt with (module docstring), learned once."""

    def __init__(self, upstream: Upstream, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._upstream = upstream
        self._clock = clock
        self._dialect: ChatDialect | None = None
        self._none_until = 0.0

    @property
    def dialect(self) -> ChatDialect | None:
        """What the backend was found to offer; None while unknown (the next count probes)."""
        if self._dialect == "none" and self._clock() >= self._none_until:
            return None
        return self._dialect

    def _found(self, dialect: ChatDialect) -> None:
        if dialect != self._dialect:
            log.info("backend tokenizer found", extra={"dialect": dialect})
        self._dialect = dialect
        if dialect == "none":
            self._none_until = self._clock() + RETRY_SECONDS

    async def count(self, request: Mapping[str, Any], headers: list[tuple[bytes, bytes]]) -> int | None:
        """The backend's count of the prompt of `request` (a chat request as a turn sends it), or None: it has no
        tokenizer, or the count failed this time. `headers`: the backend headers a turn sends (its credential)."""
        known = self.dialect
        if known == "none":
            return None
        if known == "template":
            return await self._templated(request, headers)
        answer = await _post(self._upstream, TOKENIZE, headers, orjson.dumps(chat_tokenize_body(request)))
        if answer is None or answer.status in _NOT_LEARNED:
            return None
        if answer.status == 200:
            count = _count(_field(answer.body, "count"))
            if count is not None:
                self._found("chat")
                return count
            if known is None and isinstance(_field(answer.body, "tokens"), list):
                # llama.cpp's /tokenize read no `content` from a chat request: it takes text.
                self._found("template")
                return await self._templated(request, headers)
        if known is None and (answer.status == 200 or answer.status in (400, 422) or _lacks_route(answer)):
            # 200 without a count, or a request refused for its shape (SGLang's takes only a prompt): not a tokenizer
            # of chat requests.
            self._found("none")
        elif known == "chat" and _lacks_route(answer):
            self._dialect = None  # the route went away (another server at the address): probed again next time
        return None

    async def _templated(self, request: Mapping[str, Any], headers: list[tuple[bytes, bytes]]) -> int | None:
        rendered = await _post(self._upstream, APPLY_TEMPLATE, headers, orjson.dumps(template_body(request)))
        prompt = _field(rendered.body, "prompt") if rendered is not None and rendered.status == 200 else None
        if not isinstance(prompt, str):
            if rendered is not None and _lacks_route(rendered):
                self._found("none")
            return None
        asked = {"content": prompt, "add_special": True, "parse_special": True}
        tokenized = await _post(self._upstream, TOKENIZE, headers, orjson.dumps(asked))
        tokens = _field(tokenized.body, "tokens") if tokenized is not None and tokenized.status == 200 else None
        return len(tokens) if isinstance(tokens, list) else None


def _is_anthropic_error(raw: bytes) -> bool:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False
    return _field(body, "type") == "error" and isinstance(_field(body, "error"), dict)


class MessagesCounter:
    """Whether one Messages backend counts with `POST /v1/messages/count_tokens`, learned from its answers."""

    def __init__(self, upstream: Upstream, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._upstream = upstream
        self._clock = clock
        self._none_until = 0.0

    @property
    def has_none(self) -> bool:
        """The backend was found without the route lately (it is asked again after RETRY_SECONDS)."""
        return self._clock() < self._none_until

    async def count(self, path_and_query: str, headers: list[tuple[bytes, bytes]], body: bytes) -> CountReply | None:
        """The backend's answer to `body` (its count, or its refusal in its own words), or None when it has no such
        route. A backend that cannot be reached raises as a relay's does (502, 504)."""
        if self.has_none:
            return None
        response = await self._upstream.send("POST", path_and_query, headers, body)
        try:
            raw = await response.read()
        finally:
            await response.aclose()
        # An error in the API's own shape is the backend judging this request (an unknown model is a 404 there).
        if response.status in _NO_ROUTE and not _is_anthropic_error(raw):
            log.info("backend has no count_tokens", extra={"status": response.status})
            self._none_until = self._clock() + RETRY_SECONDS
            return None
        return CountReply(response.status, response.headers, raw)
