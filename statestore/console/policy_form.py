"""A retention policy as an HTML form: built from the policy's field definitions (statestore/admin.py), never from a
list of its own, so a field added to the policy appears in the console unchanged; and the form's values turned back
into the values `validate_policy` checks, each problem placed beside the field it concerns."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from statestore.admin import PolicyField, PolicyLayers, policy_fields, validate_policy
from statestore.errors import InvalidRequest
from statestore.policy import Policy

LAYERS = ("tenant", "default", "settings")


@dataclass(frozen=True, slots=True)
class FieldRow:
    field: PolicyField
    value: Any  # what the form shows: the submitted text after a refused save, else the effective value
    error: str | None
    layers: dict[str, Any]  # layer → its value, absent layers left out
    source: str  # the layer the effective value comes from


def field_rows(
    layers: PolicyLayers, *, submitted: Mapping[str, Any] | None = None, errors: Mapping[str, str] | None = None
) -> list[FieldRow]:
    values = {"tenant": layers.tenant, "default": layers.default, "settings": layers.settings}
    effective = asdict(layers.effective)
    rows = []
    for field in policy_fields():
        per_layer = {name: getattr(policy, field.name) for name, policy in values.items() if policy is not None}
        shown = submitted[field.name] if submitted is not None and field.name in submitted else effective[field.name]
        rows.append(
            FieldRow(
                field=field,
                value=shown,
                error=(errors or {}).get(field.name),
                layers=per_layer,
                source=layers.source,
            )
        )
    return rows


def _parse(field: PolicyField, form: Mapping[str, str]) -> Any:
    if field.kind == "bool":
        # An unticked checkbox is not submitted at all.
        return form.get(field.name) == "on"
    text = form.get(field.name, "").strip()
    if not text:
        if field.optional:
            return None
        raise ValueError("is required")
    if field.kind == "int":
        if text in field.choices:
            return text
        if not text.lstrip("-").isdigit() or len(text) > 20:
            raise ValueError("must be a whole number" + "".join(f" or {word}" for word in field.choices))
        return int(text)
    if field.kind == "choice" and text not in field.choices:
        raise ValueError(f"must be one of {', '.join(field.choices)}")
    if field.kind == "float":
        try:
            return float(text)
        except ValueError:
            raise ValueError("must be a number") from None
    return text


def policy_from_form(form: Mapping[str, str]) -> tuple[Policy | None, dict[str, Any], dict[str, str]]:
    """(the valid policy or None, the values as submitted, field name → what is wrong with it). A problem that names
    no single field is filed under "" (shown above the form)."""
    values: dict[str, Any] = {}
    submitted: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for field in policy_fields():
        submitted[field.name] = form.get(field.name) == "on" if field.kind == "bool" else form.get(field.name, "")
        try:
            values[field.name] = _parse(field, form)
        except ValueError as exc:
            errors[field.name] = f"{field.name} {exc}"
    if errors:
        return None, submitted, errors
    try:
        return validate_policy(values), submitted, {}
    except InvalidRequest as exc:
        # validate_policy's messages start with the field they are about, when there is one.
        first = exc.message.split(" ", 1)[0]
        return None, submitted, {first if first in values else "": exc.message}
