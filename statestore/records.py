"""`@record`: the dataclass of a value a turn builds and passes on, immutable to mypy, plain at run time.

A frozen dataclass sets each field in `__init__` through `object.__setattr__`, a call of its own per field; a turn
builds some ten such values (a Responses turn its items, the parent row, the new response, its placement...; a
threaded turn its leased thread, reply, usage and commit), and those calls were a measurable part of a continue's
work (bench/README.md, "Instructions, not samples": 72k and 56k machine instructions a turn). Declared through
`dataclass_transform(frozen_default=True)`, a record is frozen where it matters for correctness, in the type checker:
assigning to a field is a mypy error, as it was. At run time it is `dataclass(slots=True)`: fields set as plain slot
stores, and no `__hash__` (a record is never a key)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar, dataclass_transform

T = TypeVar("T")


@dataclass_transform(frozen_default=True, field_specifiers=(field,))
def record(cls: type[T]) -> type[T]:
    return dataclass(slots=True)(cls)
