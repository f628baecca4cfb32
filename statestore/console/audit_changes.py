"""What an audit entry changed, as the audit page shows it: the fields whose values differ, old → new, rather than
two whole records side by side. The whole record stays one click away (the page's <details>)."""

from __future__ import annotations

from dataclasses import dataclass

import orjson

ABSENT = "—"


@dataclass(frozen=True, slots=True)
class Change:
    field: str  # "" when the record is not an object (nothing to name)
    old: str
    new: str


def value_text(value: object) -> str:
    """A value as the API spells it: strings bare, everything else as compact JSON (true, null, 600, [...])."""
    return value if isinstance(value, str) else orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


_MISSING = object()


def _shown(value: object) -> str:
    return ABSENT if value is None or value is _MISSING else value_text(value)


def changes(before: object, after: object) -> list[Change]:
    """The fields that differ between two records, in the order the newer one (else the older) lists them. A record
    created (no before) or deleted (no after) shows each of its fields that has a value, from or to "—"."""
    if before is None and after is None:
        return []
    if not isinstance(before, dict | None) or not isinstance(after, dict | None):
        if before == after:
            return []
        return [Change("", _shown(before), _shown(after))]
    old, new = before or {}, after or {}
    fields = [*new, *(name for name in old if name not in new)]
    return [
        Change(
            str(name),
            _shown(old.get(name, _MISSING)),
            _shown(new.get(name, _MISSING)),
        )
        for name in fields
        # A field absent on one side and null on the other did not change (a new key's revoked_ms, say).
        if old.get(name) != new.get(name)
    ]


def full_record(value: object) -> str:
    """A record whole, indented, for reading on demand."""
    return "" if value is None else orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode()
