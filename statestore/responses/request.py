"""A `POST /v1/responses` body, validated by its model, translated into the parts of a Chat Completions request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from statestore.responses.errors import BadRequest
from statestore.responses.items import normalise_input
from statestore.responses.request_schemas import (
    FunctionToolParam,
    ResponseCompactRequest,
    ResponseCreateRequest,
    ResponseInputTokensRequest,
    TextParam,
)
from statestore.responses.response_object import ECHO_DEFAULTS
from statestore.responses.schemas import FormatJsonObject, FormatText, FunctionChoice
from statestore.responses.validation import read_body, read_value


@dataclass(slots=True)
class TurnRequest:
    model: str
    input: list[dict[str, Any]]
    instructions: str | None
    previous_response_id: str | None
    conversation_id: str | None
    store: bool
    stream: bool
    metadata: dict[str, str]
    truncation: str
    background: bool = False  # run detached from the request (docs/responses.md, "Background responses")
    # `context_management` asked for compaction (docs/responses.md), past this many tokens (None: the policy's trigger).
    compaction: bool = False
    compact_threshold: int | None = None
    # What the Response object says of the request (responses/response_object.py): as sent, else the defaults.
    echo: dict[str, Any] = field(default_factory=lambda: dict(ECHO_DEFAULTS))
    # The Chat Completions request's fields other than `messages`.
    chat_params: dict[str, Any] = field(default_factory=dict)


def read_turn(raw: bytes) -> TurnRequest:
    """A `POST /v1/responses` body, validated by its model, as a turn; or a 400 naming the field."""
    return _turn_of(read_body(ResponseCreateRequest, raw))


def turn_of_event(body: dict[str, Any]) -> TurnRequest:
    """A `response.create` event's body (WebSocket mode: its `type` taken off) as a turn, validated as a POST's."""
    return _turn_of(read_value(ResponseCreateRequest, body))


def read_count(raw: bytes) -> TurnRequest:
    """A `POST /v1/responses/input_tokens` body as the turn whose input it counts (never stored, never streamed); or
    a 400 naming the field. Without a model, none is sent to the tokenizer (a server of one model needs none)."""
    body = read_body(ResponseInputTokensRequest, raw)
    # The count's fields are a turn's, validated by the same types: the turn is built as a create's is.
    turn = _turn_of(
        ResponseCreateRequest.model_construct(
            model=body.model or "",
            input=body.input if body.input is not None else [],
            instructions=body.instructions,
            previous_response_id=body.previous_response_id,
            conversation=body.conversation,
            tools=body.tools,
            tool_choice=body.tool_choice,
            parallel_tool_calls=body.parallel_tool_calls,
            text=body.text,
            truncation=body.truncation,
            store=False,
        )
    )
    if body.model is None:
        del turn.chat_params["model"]
    return turn


def _turn_of(body: ResponseCreateRequest) -> TurnRequest:
    conversation = body.conversation
    if conversation is not None and body.previous_response_id is not None:
        raise BadRequest(
            "Mutually exclusive parameters: 'previous_response_id' and 'conversation'.",
            param="conversation",
            code="invalid_value",
        )
    turn = TurnRequest(
        model=body.model,
        input=normalise_input(body.input),
        instructions=body.instructions,
        previous_response_id=body.previous_response_id,
        conversation_id=conversation if isinstance(conversation, str | None) else conversation.id,
        store=body.store is not False,
        stream=bool(body.stream),
        metadata=body.metadata or {},
        truncation=body.truncation or "disabled",
        background=bool(body.background),
    )
    if turn.background and not turn.store:
        raise BadRequest("Background mode requires store to be true.", param="background", code="invalid_value")
    if body.context_management:
        if conversation is not None:
            # A conversation's context is its items every turn: there is no stored context a compaction could move.
            raise BadRequest(
                "Compaction is not supported on a conversation; continue with previous_response_id.",
                param="context_management",
                code="unsupported_value",
            )
        turn.compaction = True
        turn.compact_threshold = body.context_management[0].compact_threshold
    _translate_params(body, turn)
    return turn


def read_compact(raw: bytes) -> TurnRequest:
    """A `POST /v1/responses/compact` body as the turn whose context it compacts: nothing of it is stored."""
    body = read_body(ResponseCompactRequest, raw)
    turn = TurnRequest(
        model=body.model,
        input=normalise_input(body.input) if body.input is not None else [],
        instructions=body.instructions,
        previous_response_id=body.previous_response_id,
        conversation_id=None,
        store=False,
        stream=False,
        metadata={},
        truncation="disabled",
        compaction=True,
    )
    turn.chat_params = {"model": turn.model}
    return turn


def _tool(tool: FunctionToolParam) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the tool as echoed in the Response, as sent to the backend)."""
    echoed = {
        "type": "function",
        "name": tool.name,
        "description": tool.description,
        "parameters": tool.parameters,
        "strict": tool.strict,
    }
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    if tool.parameters is not None:
        function["parameters"] = tool.parameters
    if tool.strict is not None:
        function["strict"] = tool.strict
    return echoed, {"type": "function", "function": function}


def _response_format(text: TextParam | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the format as echoed in the Response, as sent to the backend): a JSON schema format is echoed with its
    `description` and `strict` (null and false when left out, as the backend takes them), and sent as given."""
    fmt = text.format if text is not None else None
    if fmt is None or isinstance(fmt, FormatText):
        return ECHO_DEFAULTS["text"], None
    given = fmt.model_dump(by_alias=True, exclude_none=True)
    if isinstance(fmt, FormatJsonObject):
        return {"format": given}, {"type": "json_object"}
    schema = {k: v for k, v in given.items() if k in ("name", "schema", "description", "strict")}
    echoed = {**given, "description": given.get("description"), "strict": given.get("strict", False)}
    return {"format": echoed}, {"type": "json_schema", "json_schema": schema}


# Sent to the backend as they are, and echoed; absent, the Response says the defaults (ECHO_DEFAULTS).
_SAMPLING = ("temperature", "top_p", "presence_penalty", "frequency_penalty")
# Echoed as sent, never sent: no backend field does what they ask (response_object.py says why).
_ECHOED_ONLY = ("top_logprobs", "max_tool_calls", "safety_identifier", "prompt_cache_key")


def _translate_params(body: ResponseCreateRequest, turn: TurnRequest) -> None:
    params: dict[str, Any] = {"model": turn.model}
    echo = dict(ECHO_DEFAULTS)
    for name in _SAMPLING:
        value = getattr(body, name)
        if value is not None:
            params[name] = echo[name] = value
    for name in _ECHOED_ONLY:
        value = getattr(body, name)
        if value is not None:
            echo[name] = value
    if body.max_output_tokens is not None:
        params["max_tokens"] = echo["max_output_tokens"] = body.max_output_tokens
    translated = [_tool(tool) for tool in body.tools or ()]
    echo["tools"] = [echoed for echoed, _ in translated]
    if translated:
        params["tools"] = [sent for _, sent in translated]
    choice = body.tool_choice
    if isinstance(choice, FunctionChoice):
        echo["tool_choice"] = {"type": "function", "name": choice.name}
        params["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        params["tool_choice"] = echo["tool_choice"] = choice
    parallel = body.parallel_tool_calls
    if parallel is not None:
        echo["parallel_tool_calls"] = parallel
        if translated:
            params["parallel_tool_calls"] = parallel
    echo["text"], response_format = _response_format(body.text)
    if response_format is not None:
        params["response_format"] = response_format
    turn.echo = echo
    turn.chat_params = params


def chat_body(params: dict[str, Any], segments: list[bytes], *, stream: bool) -> bytes:
    """The backend's request: the translated fields, then `messages` spliced in from the already-joined segments
    (empty ones skipped), in one join: a long context is copied once, into the body."""
    fields = dict(params, stream=stream)
    if stream:
        fields["stream_options"] = {"include_usage": True}
    head = orjson.dumps(fields)
    messages = [segment for segment in segments if segment]
    parts = [head[:-1], b',"messages":[']
    for i, segment in enumerate(messages):
        if i:
            parts.append(b",")
        parts.append(segment)
    parts.append(b"]}")
    return b"".join(parts)
