"""The Open Responses specification's OpenAPI document (version 2026-04-24, as the pinned `llm-comply` bundles it),
and what a live value breaks of it.

Where the specification and the `openai` SDK disagree, statestore follows the SDK on the wire (README, "The Open
Responses specification"); `DEPARTURES` patches the document there, and only there, each with its reason."""

from __future__ import annotations

import functools
import json
from importlib.resources import files
from typing import Any

from jsonschema import Draft202012Validator
from llm_comply.schema import SSE_EVENT_TO_SCHEMA

VERSION = "2026-04-24"

# (schema, property, what the document says instead, why).
DEPARTURES: list[tuple[str, str, dict[str, Any], str]] = [
    (
        "JsonSchemaResponseFormat",
        "schema",
        {"type": "object"},
        "the document allows only null as a JSON schema format's `schema`; the SDK's type (and every client) sends and "
        "reads the JSON Schema object, which statestore echoes",
    ),
]


@functools.cache
def specification() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(files("llm_comply").joinpath("specs", "openresponses.json").read_text())
    assert document["info"]["version"] == VERSION
    schemas = document["components"]["schemas"]
    for schema, name, instead, _why in DEPARTURES:
        schemas[schema]["properties"][name] = instead
    return document


@functools.cache
def _validator(schema_name: str) -> Draft202012Validator:
    document = specification()
    assert schema_name in document["components"]["schemas"], schema_name
    return Draft202012Validator({"$ref": f"#/components/schemas/{schema_name}", "components": document["components"]})


def problems(value: Any, schema_name: str) -> list[str]:
    """What `value` breaks of the named schema of the specification, each with where."""
    return sorted(
        f"{'.'.join(map(str, error.absolute_path)) or '(top)'}: {error.message}"
        for error in _validator(schema_name).iter_errors(value)
    )


def response_problems(response: Any) -> list[str]:
    return problems(response, "ResponseResource")


def event_problems(event: dict[str, Any]) -> list[str]:
    """A streamed event against the specification's schema of its type; an event of a type the specification does not
    define (`response.compaction.compacting`, a background response's `response.cancelled`) is checked for the
    Response it carries, if any."""
    schema_name = SSE_EVENT_TO_SCHEMA.get(str(event.get("type")))
    if schema_name is not None:
        return problems(event, schema_name)
    return response_problems(event["response"]) if "response" in event else []
