"""A request body read by its model (statestore/responses/request_schemas.py), and the model's first complaint as
OpenAI's 400, naming the field by its path (`input[0].content[1]`) as OpenAI does."""

from __future__ import annotations

from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from statestore.responses.errors import BadRequest

Model = TypeVar("Model", bound=BaseModel)
_CODES = {"missing": "missing_required_parameter", "extra_forbidden": "unknown_parameter"}
_OURS = frozenset({"invalid_value", "invalid_type", "unsupported_value"})  # the models' own error types


def read_json(raw: bytes) -> dict[str, Any]:
    # orjson, not pydantic's parser, reads the JSON: it refuses what the stores could not write back (NaN, Infinity),
    # and the hot path parses once either way.
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise BadRequest("We could not parse the JSON body of your request.", code="invalid_json") from None
    if not isinstance(parsed, dict):
        raise BadRequest("The request body must be a JSON object.", code="invalid_json")
    return parsed


def read_body(model: type[Model], raw: bytes) -> Model:
    """The body validated by its model, strictly (a "true" is no boolean, a 1 no string), or a 400."""
    return read_value(model, read_json(raw))


def read_value(model: type[Model], value: dict[str, Any]) -> Model:
    """A body already parsed (a WebSocket event's), validated as `read_body` validates one."""
    try:
        return model.model_validate(value, strict=True)
    except ValidationError as exc:
        raise refusal(exc) from None


def refusal(exc: ValidationError) -> BadRequest:
    errors = exc.errors(include_url=False, include_context=False, include_input=False)
    unknown = sorted(_path(error["loc"]) for error in errors if error["type"] == "extra_forbidden")
    if unknown:  # an unknown parameter is named first, as it always was
        name = unknown[0][:64]
        return BadRequest(f"Unknown parameter: '{name}'.", param=name, code="unknown_parameter")
    error = errors[0]
    loc = error["loc"]
    kind = error["type"]
    if kind == "literal_error" and loc and loc[-1] == "type":
        # an unsupported `type` names the object carrying it: the object is what the client replaces
        carrier = _path(loc[:-1])
        message = f"Invalid value for '{carrier}.type': not supported here."
        return BadRequest(message, param=carrier, code="unsupported_value")
    param = _path(loc)
    if kind == "missing":
        return BadRequest(f"Missing required parameter: '{param}'.", param=param, code=_CODES[kind])
    code = kind if kind in _OURS else "invalid_value"
    return BadRequest(f"Invalid '{param}': {_said(error)}.", param=param or None, code=code)


def _said(error: ErrorDetails) -> str:
    # pydantic's messages name the constraint, never the value sent
    message = error["msg"]
    return message[:1].lower() + message[1:]


def _path(loc: tuple[int | str, ...]) -> str:
    """`input[0].content[1]`: a union member's `<tag>` is no part of the path."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not part.startswith("<"):
            path += f".{part}" if path else part
    return path
