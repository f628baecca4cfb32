"""A `POST /v1/responses` body read, checked and translated into the parts of a Chat Completions request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from statestore.responses.errors import BadRequest
from statestore.responses.items import normalise_input

_KNOWN_FIELDS = frozenset(
    {
        "model", "input", "instructions", "previous_response_id", "conversation", "store", "stream", "metadata",
        "tools", "tool_choice", "parallel_tool_calls", "temperature", "top_p", "max_output_tokens", "text",
        "truncation", "user", "safety_identifier", "prompt_cache_key", "include", "reasoning", "background",
        "service_tier", "stream_options", "top_logprobs", "max_tool_calls",
    }
)  # fmt: skip
MAX_METADATA_PAIRS = 16


def _bad(message: str, param: str | None, code: str | None = "invalid_value") -> BadRequest:
    return BadRequest(message, param=param, code=code)


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
    # Echoed into the Response object as the client sent them.
    echo: dict[str, Any] = field(default_factory=dict)
    # The Chat Completions request's fields other than `messages`.
    chat_params: dict[str, Any] = field(default_factory=dict)


def read_metadata(value: object, param: str = "metadata") -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_METADATA_PAIRS:
        raise _bad(f"Invalid '{param}': an object of at most {MAX_METADATA_PAIRS} pairs expected.", param)
    for key, text in value.items():
        if not isinstance(text, str) or len(key) > 64 or len(text) > 512:
            raise _bad(f"Invalid '{param}': keys up to 64 and string values up to 512 characters.", param)
    return dict(value)


def _number(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise _bad(f"Invalid '{name}': a number between {low} and {high} expected.", name)
    return float(value) if isinstance(value, float) else value


def _tool(tool: object, i: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the tool as echoed in the Response, as sent to the backend)."""
    param = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise _bad(f"Invalid '{param}': only function tools are supported by this backend.", param, "unsupported_value")
    name = tool.get("name")
    if not isinstance(name, str) or not 1 <= len(name) <= 128:
        raise _bad(f"Invalid '{param}.name'.", f"{param}.name")
    parameters = tool.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise _bad(f"Invalid '{param}.parameters': an object expected.", f"{param}.parameters")
    description = tool.get("description")
    if description is not None and not isinstance(description, str):
        raise _bad(f"Invalid '{param}.description'.", f"{param}.description")
    strict = tool.get("strict")
    echoed = {"type": "function", "name": name, "description": description, "parameters": parameters, "strict": strict}
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    if parameters is not None:
        function["parameters"] = parameters
    if strict is not None:
        function["strict"] = bool(strict)
    return echoed, {"type": "function", "function": function}


def _tool_choice(value: object) -> Any:
    if value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise _bad("Invalid 'tool_choice'.", "tool_choice")


def _response_format(text: object) -> tuple[dict[str, Any], dict[str, Any] | None]:
    if text is None:
        return {"format": {"type": "text"}}, None
    if not isinstance(text, dict):
        raise _bad("Invalid 'text': an object expected.", "text")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {"format": {"type": "text"}}, None
    if kind == "json_object":
        return {"format": fmt}, {"type": "json_object"}
    if kind == "json_schema" and isinstance(fmt.get("name"), str) and isinstance(fmt.get("schema"), dict):
        schema = {k: fmt[k] for k in ("name", "schema", "description", "strict") if fmt.get(k) is not None}
        return {"format": fmt}, {"type": "json_schema", "json_schema": schema}
    raise _bad("Invalid 'text.format'.", "text.format")


def _conversation(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, dict):
        value = value.get("id")
    if not isinstance(value, str) or not value:
        raise _bad("Invalid 'conversation': an id or {\"id\": ...} expected.", "conversation")
    return value


def read_turn(body: dict[str, Any]) -> TurnRequest:
    unknown = sorted(set(body) - _KNOWN_FIELDS)
    if unknown:
        raise _bad(f"Unknown parameter: '{unknown[0][:64]}'.", unknown[0][:64], "unknown_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not 1 <= len(model) <= 256:
        raise _bad("Missing required parameter: 'model'.", "model", "missing_required_parameter")
    if "input" not in body:
        raise _bad("Missing required parameter: 'input'.", "input", "missing_required_parameter")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("Invalid 'instructions': a string expected.", "instructions")
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise _bad("Invalid 'previous_response_id'.", "previous_response_id")
    conversation = _conversation(body.get("conversation"))
    if conversation is not None and previous is not None:
        raise _bad(
            "Mutually exclusive parameters: 'previous_response_id' and 'conversation'.", "conversation", "invalid_value"
        )
    store, stream = body.get("store", True), body.get("stream", False)
    if store is None:
        store = True
    if not isinstance(store, bool) or not isinstance(stream, bool | None):
        raise _bad("Invalid 'store' or 'stream': a boolean expected.", "store")
    truncation = body.get("truncation") or "disabled"
    if truncation not in ("auto", "disabled"):
        raise _bad("Invalid 'truncation': 'auto' or 'disabled'.", "truncation")
    turn = TurnRequest(
        model=model,
        input=normalise_input(body["input"]),
        instructions=instructions,
        previous_response_id=previous,
        conversation_id=conversation,
        store=store,
        stream=bool(stream),
        metadata=read_metadata(body.get("metadata")),
        truncation=str(truncation),
    )
    _translate_params(body, turn)
    return turn


def _translate_params(body: dict[str, Any], turn: TurnRequest) -> None:
    params: dict[str, Any] = {"model": turn.model}
    echo: dict[str, Any] = {}
    for name, low, high in (("temperature", 0, 2), ("top_p", 0, 1)):
        value = _number(body, name, low, high)
        echo[name] = value
        if value is not None:
            params[name] = value
    max_output = body.get("max_output_tokens")
    if max_output is not None:
        if isinstance(max_output, bool) or not isinstance(max_output, int) or not 1 <= max_output <= 10_000_000:
            raise _bad("Invalid 'max_output_tokens': a positive integer expected.", "max_output_tokens")
        params["max_tokens"] = max_output
    echo["max_output_tokens"] = max_output
    tools = body.get("tools") or []
    if not isinstance(tools, list) or len(tools) > 512:
        raise _bad("Invalid 'tools': an array of at most 512 tools expected.", "tools")
    translated = [_tool(tool, i) for i, tool in enumerate(tools)]
    echo["tools"] = [echoed for echoed, _ in translated]
    if translated:
        params["tools"] = [sent for _, sent in translated]
    choice = body.get("tool_choice")
    echo["tool_choice"] = choice if choice is not None else "auto"
    if choice is not None:
        params["tool_choice"] = _tool_choice(choice)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("Invalid 'parallel_tool_calls': a boolean expected.", "parallel_tool_calls")
    echo["parallel_tool_calls"] = True if parallel is None else parallel
    if parallel is not None and translated:
        params["parallel_tool_calls"] = parallel
    echo["text"], response_format = _response_format(body.get("text"))
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
