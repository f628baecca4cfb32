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
from sqlalchemy.dialects.postgresql.asyncpg import PGDialect_asyncpg
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
_ASYNCPG = PGDialect_asyncpg()  # type: ignore[no-untyped-call]


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
        self._set(params, _NAMED.sub(number, sql), names, {}, durable=durable)

    @classmethod
    def compiled(cls, params: type[P], statement: ClauseElement, *, durable: bool) -> PgStatement[P]:
        """A Core statement compiled once for asyncpg: its `$n` SQL as SQLAlchemy's asyncpg dialect renders it, each
        `core_param` bound from its field, each constant SQLAlchemy made a parameter (a literal) bound as its value."""
        compiled = statement.compile(dialect=_ASYNCPG)
        assert isinstance(compiled, SQLCompiler) and compiled.positiontup is not None
        names = [name.removeprefix(CORE_PREFIX) for name in compiled.positiontup]
        constants = {
            name.removeprefix(CORE_PREFIX): compiled.binds[name].value
            for name in compiled.positiontup
            if not name.startswith(CORE_PREFIX)
        }
        self = cls.__new__(cls)
        self._set(params, compiled.string, names, constants, durable=durable)
        return self

    def _set(self, params: type[P], sql: str, names: list[str], constants: dict[str, Any], *, durable: bool) -> None:
        fields = set(field_names(params))
        if set(names) - set(constants) != fields:
            used = set(names) - set(constants)
            unused, unknown = sorted(fields - used), sorted(used - fields)
            raise TypeError(f"{params.__name__}: fields the SQL does not use {unused}, names with no field {unknown}")
        self.sql = sql
        self.params = params
        self.names: tuple[str, ...] = tuple(names)
        self.durable = durable
        if constants:
            # Rare (a literal in a Core statement): the values in order, fields and constants mixed.
            order = [(name in constants, constants.get(name), name) for name in names]
            self._get: Callable[[P], tuple[Any, ...]] = lambda p: tuple(
                value if constant else getattr(p, name) for constant, value, name in order
            )
            return
        getter = attrgetter(*names)
        # attrgetter of one name returns the value itself, of several a tuple.
        self._get = (lambda p: (getter(p),)) if len(names) == 1 else getter

    def bind(self, params: P) -> tuple[Any, ...]:
        """The values in `$n` order."""
        return self._get(params)


@final
class CoreStatement(Generic[P]):
    """A SQLAlchemy Core statement built once with `core_param` bind parameters, one per field of `params` (checked
    at import, as for PgStatement); `values` binds an object to it."""

    __slots__ = ("params", "pg", "statement")

    def __init__(self, params: type[P], statement: Executable, *, durable: bool | None = None) -> None:
        """`durable` given: the statement is written once for both databases, and `pg` is it compiled for asyncpg
        (PostgreSQL's hot path runs it there, as a prepared statement, with no SQLAlchemy between); else it runs
        through Core only."""
        assert isinstance(statement, ClauseElement)
        named = {name for name in bind_names(statement) if name.startswith(CORE_PREFIX)}
        fields = {CORE_PREFIX + name for name in field_names(params)}
        if named != fields:
            unused, unknown = sorted(fields - named), sorted(named - fields)
            raise TypeError(f"{params.__name__}: fields not bound {unused}, binds with no field {unknown}")
        self.params = params
        self.statement = statement
        self.pg: PgStatement[P] | None = (
            None if durable is None else PgStatement.compiled(params, statement, durable=durable)
        )

    def values(self, params: P) -> dict[str, Any]:
        return core_values(params)

    def on_pg(self) -> PgStatement[P]:
        """The statement compiled for asyncpg: taken once, where its module is imported."""
        if self.pg is None:
            raise TypeError(f"{self.params.__name__}: a statement for Core only (no durable= given)")
        return self.pg


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
