"""The retention policy's fields, defined once (docs/protocol.md §8, §9): the policy record, its validation, the admin
API's request model, the CLI's flags and any form that edits a policy are all derived from `POLICY_FIELDS`.

A field is `required` when a policy update must name it (the fields policies had from the start); the others have a
default, so a client that predates them can still put a policy."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["bool", "int", "ratio", "choice", "text"]

CONTEXT_STRATEGIES = ("none", "truncate", "summarize")
# A window the backend states (docs/protocol.md §9, "context_window_tokens: auto"): the value a field with `auto`
# accepts besides a number, and how its integer column holds it (no window is that small: the field's minimum is far
# above it).
AUTO = "auto"
STORED_AUTO = 0
MAX_TTL_SECONDS = 366 * 86_400
INT32_MAX = 2**31 - 1  # policies.max_messages and threads.head_position are 32-bit integers
INT64_MAX = 2**63 - 1


@dataclass(frozen=True, slots=True)
class PolicyField:
    name: str
    kind: Kind
    help: str
    required: bool = True
    default: Any = None
    nullable: bool = False
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    max_length: int | None = None
    auto: bool = False  # an "int" that may also be AUTO

    @property
    def python_type(self) -> Any:
        base: Any = {"bool": bool, "int": int, "ratio": float, "choice": str, "text": str}[self.kind]
        if self.auto:
            base = base | Literal["auto"]
        return base | None if self.nullable else base

    def to_column(self, value: Any) -> Any:
        return STORED_AUTO if self.auto and value == AUTO else value

    def from_column(self, value: Any) -> Any:
        if self.kind == "bool":
            return bool(value)
        return AUTO if self.auto and value == STORED_AUTO else value

    def describe(self) -> dict[str, Any]:
        """The field as data, for a client that renders policy forms."""
        return {
            "name": self.name,
            "kind": self.kind,
            "help": self.help,
            "required": self.required,
            "default": self.default,
            "nullable": self.nullable,
            "minimum": self.minimum,
            "maximum": self.maximum,
            "choices": list(self.choices),
            "max_length": self.max_length,
            "auto": self.auto,
        }


POLICY_FIELDS: tuple[PolicyField, ...] = (
    PolicyField("threads_enabled", "bool", "whether thread requests are served"),
    PolicyField("sessions_enabled", "bool", "whether the statestore-session-id header is honoured"),
    PolicyField("default_ttl_seconds", "int", "TTL of a thread that asks for none", minimum=1, maximum=MAX_TTL_SECONDS),
    PolicyField("max_ttl_seconds", "int", "the longest TTL a thread may have", minimum=1, maximum=MAX_TTL_SECONDS),
    PolicyField("max_thread_bytes", "int", "the most bytes a rebuilt request may carry", minimum=1, maximum=INT64_MAX),
    PolicyField("max_messages", "int", "the most messages a rebuilt request may carry", minimum=2, maximum=INT32_MAX),
    PolicyField(
        "context_strategy",
        "choice",
        "what to do when a thread's context nears the window: none, truncate or summarize",
        required=False,
        default="none",
        choices=CONTEXT_STRATEGIES,
    ),
    PolicyField(
        "context_window_tokens",
        "int",
        "the model's context window in tokens (needed by truncate and summarize), or auto: as the backend states it",
        required=False,
        nullable=True,
        minimum=1024,
        maximum=INT32_MAX,
        auto=True,
    ),
    PolicyField(
        "context_trigger_ratio",
        "ratio",
        "share of the window at which the strategy acts",
        required=False,
        default=0.8,
        minimum=0.05,
        maximum=1.0,
    ),
    PolicyField(
        "context_target_ratio",
        "ratio",
        "share of the window the context is brought down to",
        required=False,
        default=0.5,
        minimum=0.01,
        maximum=0.95,
    ),
    PolicyField(
        "summary_model",
        "text",
        "model that writes summaries (default: the turn's model)",
        required=False,
        nullable=True,
        max_length=200,
    ),
    PolicyField(
        "summary_instructions",
        "text",
        "instructions for the summary (default: a built-in prompt)",
        required=False,
        nullable=True,
        max_length=20_000,
    ),
    PolicyField(
        "max_background_turns",
        "int",
        "background responses an owner may have queued or running at once (0: background off)",
        required=False,
        default=16,
        minimum=0,
        maximum=INT32_MAX,
    ),
    PolicyField(
        "idempotency_ttl_seconds",
        "int",
        "how long a write's outcome is kept under its Idempotency-Key, for retries to get it again",
        required=False,
        default=86_400,
        minimum=60,
        maximum=MAX_TTL_SECONDS,
    ),
)

FIELD_NAMES = tuple(field.name for field in POLICY_FIELDS)
BY_NAME = {field.name: field for field in POLICY_FIELDS}


class PolicyValueError(ValueError):
    """A policy value that cannot be accepted; the message names the field."""


def _check(field: PolicyField, value: Any) -> Any:
    name = field.name
    if value is None:
        if field.nullable:
            return None
        raise PolicyValueError(f"{name} must not be null")
    if field.kind == "bool":
        if not isinstance(value, bool):
            raise PolicyValueError(f"{name} must be true or false")
        return value
    if field.kind in ("choice", "text"):
        if not isinstance(value, str):
            raise PolicyValueError(f"{name} must be a string")
        if field.choices and value not in field.choices:
            raise PolicyValueError(f"{name} must be one of {', '.join(field.choices)}")
        if field.max_length is not None and len(value) > field.max_length:
            raise PolicyValueError(f"{name} must be at most {field.max_length} characters")
        if "\x00" in value or (field.kind == "text" and not value.strip()):
            raise PolicyValueError(f"{name} must be non-empty text without NUL (or null)")
        return value
    if field.kind == "int":
        if field.auto and value == AUTO:
            return AUTO
        if not isinstance(value, int) or isinstance(value, bool):
            raise PolicyValueError(f"{name} must be a whole number" + (f" or {AUTO}" if field.auto else ""))
    elif not isinstance(value, int | float) or isinstance(value, bool) or math.isnan(value):
        raise PolicyValueError(f"{name} must be a number")
    if field.minimum is not None and value < field.minimum:
        raise PolicyValueError(f"{name} must be at least {field.minimum:g}")
    if field.maximum is not None and value > field.maximum:
        raise PolicyValueError(f"{name} must be at most {field.maximum:g}")
    return float(value) if field.kind == "ratio" else value


def validate_values(values: Any) -> dict[str, Any]:
    """Every field of a policy from untrusted input, checked, defaults filled in; raises PolicyValueError."""
    if not isinstance(values, dict):
        raise PolicyValueError("a policy must be an object")
    unknown = sorted(set(values) - set(FIELD_NAMES))
    if unknown:
        raise PolicyValueError(f"unknown policy fields: {', '.join(map(str, unknown))}")
    missing = [f.name for f in POLICY_FIELDS if f.required and f.name not in values]
    if missing:
        raise PolicyValueError(f"missing policy fields: {', '.join(missing)}")
    checked = {f.name: _check(f, values.get(f.name, f.default)) for f in POLICY_FIELDS}
    if checked["default_ttl_seconds"] > checked["max_ttl_seconds"]:
        raise PolicyValueError("default_ttl_seconds must not exceed max_ttl_seconds")
    if checked["context_target_ratio"] >= checked["context_trigger_ratio"]:
        raise PolicyValueError("context_target_ratio must be below context_trigger_ratio")
    if checked["context_strategy"] != "none" and checked["context_window_tokens"] is None:
        raise PolicyValueError(f"context_window_tokens is needed by context_strategy {checked['context_strategy']}")
    return checked
