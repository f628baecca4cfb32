"""A statement and its parameters, bound by name.

Each statement has one parameter object: a dataclass whose fields are the statement's parameters, keyword-only, so a
caller names every value and mypy checks each one. Not frozen: a frozen dataclass sets each field through
object.__setattr__, three times the cost of the plain one (28 fields: ~6 us against ~2 us here), and the object
lives for one call. The SQL of a prepared statement is written with the same names
(`:thread_id`) and compiled once, at import, into asyncpg's positional form (`$1`) with the order its values are
passed in; an SQL name without a field, or a field the SQL never uses, fails the import. For SQLAlchemy Core the same
object becomes a dict of bind parameters.

Binding is one C-level `attrgetter` call per statement (28 values: ~0.5 us).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from operator import attrgetter
from typing import Any, ClassVar, Generic, Protocol, TypeVar, final

from sqlalchemy import BindParameter, bindparam
from sqlalchemy.sql.base import Executable
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import ClauseElement
from sqlalchemy.sql.type_api import TypeEngine


class Params(Protocol):
    """A statement's parameter object: a dataclass."""

    __dataclass_fields__: ClassVar[dict[str, Any]]


P = TypeVar("P", bound=Params)

# `:name`, but neither a `::type` cast nor the second colon of one.
_NAMED = re.compile(r"(?<![:\w]):([a-z_][a-z0-9_]*)")
_POSITIONAL = re.compile(r"\$(\d+)")
# A Core bind parameter may not share a column's name in an UPDATE or INSERT (it would be taken as that column's
# value), so Core's names carry a prefix.
CORE_PREFIX = "p_"


def field_names(params: type[Params]) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(params))


@final
class PgStatement(Generic[P]):
    """An asyncpg prepared statement: its SQL in positional form and the field each `$n` is bound from.
    `durable`: whether it waits for its WAL flush (a turn's commit), or runs on the asynchronous-commit pool (a
    lease: store/pg_hot_path.py says why that is safe)."""

    __slots__ = ("_get", "durable", "names", "params", "sql")

    def __init__(self, params: type[P], sql: str, *, durable: bool) -> None:
        names: list[str] = []

        def number(match: re.Match[str]) -> str:
            if match[1] not in names:
                names.append(match[1])
            return f"${names.index(match[1]) + 1}"

        if _POSITIONAL.search(sql):
            raise ValueError(f"{params.__name__}: write parameters by name (:name), not $n")
        self.sql = _NAMED.sub(number, sql)
        fields = set(field_names(params))
        if set(names) != fields:
            unused, unknown = sorted(fields - set(names)), sorted(set(names) - fields)
            raise TypeError(f"{params.__name__}: fields the SQL does not use {unused}, names with no field {unknown}")
        self.params = params
        self.names: tuple[str, ...] = tuple(names)
        self.durable = durable
        getter = attrgetter(*names)
        # attrgetter of one name returns the value itself, of several a tuple.
        self._get: Callable[[P], tuple[Any, ...]] = (lambda p: (getter(p),)) if len(names) == 1 else getter

    def bind(self, params: P) -> tuple[Any, ...]:
        """The values in `$n` order."""
        return self._get(params)


@final
class CoreStatement(Generic[P]):
    """A SQLAlchemy Core statement built once with `core_param` bind parameters, one per field of `params` (checked
    at import, as for PgStatement); `values` binds an object to it."""

    __slots__ = ("params", "statement")

    def __init__(self, params: type[P], statement: Executable) -> None:
        assert isinstance(statement, ClauseElement)
        named = {name for name in bind_names(statement) if name.startswith(CORE_PREFIX)}
        fields = {CORE_PREFIX + name for name in field_names(params)}
        if named != fields:
            unused, unknown = sorted(fields - named), sorted(named - fields)
            raise TypeError(f"{params.__name__}: fields not bound {unused}, binds with no field {unknown}")
        self.params = params
        self.statement = statement

    def values(self, params: P) -> dict[str, Any]:
        return core_values(params)


def bind_names(statement: ClauseElement) -> set[str]:
    compiled = statement.compile()
    assert isinstance(compiled, SQLCompiler)
    return set(compiled.binds)


def core_param(name: str, type_: TypeEngine[Any] | type[TypeEngine[Any]] | None = None) -> BindParameter[Any]:
    """The Core bind parameter of a parameter object's field `name` (see `core_values`)."""
    return bindparam(CORE_PREFIX + name, type_=type_)


def core_values(params: Params) -> dict[str, Any]:
    """The object as Core's bind parameters (`core_param` names), for a statement built once."""
    return {CORE_PREFIX + name: getattr(params, name) for name in params.__dataclass_fields__}
