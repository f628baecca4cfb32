"""Statements bound by name (statestore/store/statement.py): every `$n` of a prepared statement is bound from exactly
one field of its parameter object, in the order asyncpg passes them; a statement whose SQL and parameter object
disagree fails where it is defined, at import; a Core statement is checked the same way. Then every statement the
store defines, found by walking its modules, is checked, so a new one is covered without being listed here."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import pkgutil
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import update

import statestore
import statestore.store
from statestore.store.schema import threads
from statestore.store.statement import (
    CoreStatement,
    PgStatement,
    bind_names,
    core_param,
    core_values,
    field_names,
)


@dataclass(slots=True, kw_only=True)
class _Take:
    thread_id: str
    now_ms: int
    token: str


_SQL = """
UPDATE threads SET lease_token = :token
WHERE id = :thread_id AND (lease_expires_ms IS NULL OR lease_expires_ms <= :now_ms) AND expires_ms > :now_ms
  AND head_position >= 0::integer
"""


def test_names_become_positions_in_first_use_order() -> None:
    statement = PgStatement(_Take, _SQL, durable=False)
    assert statement.names == ("token", "thread_id", "now_ms")
    assert "$1" in statement.sql and "$3" in statement.sql and ":" not in statement.sql.replace("::integer", "")
    assert statement.sql.count("$3") == 2  # a name used twice is one parameter
    assert statement.bind(_Take(thread_id="thr_1", now_ms=5, token="t")) == ("t", "thr_1", 5)


def test_a_cast_is_not_a_parameter() -> None:
    @dataclass(slots=True, kw_only=True)
    class One:
        ids: list[str]

    statement = PgStatement(One, "SELECT ''::bytea, cardinality(:ids::varchar[])", durable=True)
    assert statement.sql == "SELECT ''::bytea, cardinality($1::varchar[])"
    assert statement.bind(One(ids=["a"])) == (["a"],)  # one field: still a tuple


def test_a_field_the_sql_does_not_use_fails_at_definition() -> None:
    @dataclass(slots=True, kw_only=True)
    class Extra:
        thread_id: str
        now_ms: int
        token: str
        forgotten: int

    with pytest.raises(TypeError, match="forgotten"):
        PgStatement(Extra, _SQL, durable=False)


def test_a_name_without_a_field_fails_at_definition() -> None:
    @dataclass(slots=True, kw_only=True)
    class Missing:
        thread_id: str
        token: str

    with pytest.raises(TypeError, match="now_ms"):
        PgStatement(Missing, _SQL, durable=False)


def test_positional_sql_is_refused() -> None:
    with pytest.raises(ValueError, match="by name"):
        PgStatement(_Take, "UPDATE threads SET lease_token = $1 WHERE id = :thread_id", durable=False)


def test_a_core_statement_binds_by_name_and_is_checked() -> None:
    statement = CoreStatement(
        _Take,
        update(threads)
        .where(threads.c.id == core_param("thread_id"), threads.c.expires_ms > core_param("now_ms"))
        .values(lease_token=core_param("token")),
    )
    assert statement.values(_Take(thread_id="thr_1", now_ms=5, token="t")) == {
        "p_thread_id": "thr_1",
        "p_now_ms": 5,
        "p_token": "t",
    }
    with pytest.raises(TypeError, match="token"):
        CoreStatement(_Take, update(threads).where(threads.c.id == core_param("thread_id")).values(lease_token=None))


def test_core_values_names_every_field() -> None:
    assert core_values(_Take(thread_id="a", now_ms=1, token="t")) == {"p_thread_id": "a", "p_now_ms": 1, "p_token": "t"}


def _defined_statements() -> list[tuple[str, PgStatement[Any] | CoreStatement[Any]]]:
    found: list[tuple[str, PgStatement[Any] | CoreStatement[Any]]] = []
    for module_info in pkgutil.iter_modules(statestore.store.__path__, "statestore.store."):
        module = importlib.import_module(module_info.name)
        for name, value in vars(module).items():
            if isinstance(value, (PgStatement, CoreStatement)):
                found.append((f"{module_info.name}.{name}", value))
            elif dataclasses.is_dataclass(value) and not isinstance(value, type):
                # A bundle of statements (the leased log's tables).
                for field in dataclasses.fields(value):
                    inner = getattr(value, field.name)
                    if isinstance(inner, (PgStatement, CoreStatement)):
                        found.append((f"{module_info.name}.{name}.{field.name}", inner))
    return found


Defined = list[tuple[str, PgStatement[Any] | CoreStatement[Any]]]


def _compiled(statements: Defined) -> list[tuple[str, PgStatement[Any]]]:
    """The Core statements' compiled forms (those written once for both databases)."""
    return [(f"{name}.pg", s.pg) for name, s in statements if isinstance(s, CoreStatement) and s.pg is not None]


def test_every_prepared_statement_binds_each_placeholder_from_exactly_one_field() -> None:
    defined = _defined_statements()
    statements = [(name, s) for name, s in defined if isinstance(s, PgStatement)] + _compiled(defined)
    assert len(statements) >= 6, "the store's prepared statements were not found"
    for name, statement in statements:
        numbers = {int(n) for n in re.findall(r"\$(\d+)", statement.sql)}
        assert numbers == set(range(1, len(statement.names) + 1)), name
        assert sorted(statement.names) == sorted(field_names(statement.params)), name
        assert len(set(statement.names)) == len(statement.names), name
        assert not re.search(r"(?<![:\w]):[a-z_]", statement.sql), f"{name}: a name was left unbound"


def test_every_core_statement_binds_every_field() -> None:
    statements = [(name, s) for name, s in _defined_statements() if isinstance(s, CoreStatement)]
    assert statements, "the store's Core statements were not found"
    for name, statement in statements:
        binds = {b for b in bind_names(statement.statement) if b.startswith("p_")}
        assert binds == {f"p_{field}" for field in field_names(statement.params)}, name


def test_mypy_refuses_a_parameter_object_missing_a_field(tmp_path: Path) -> None:
    """The parameter objects are what makes a wrong, missing or merely positional value a type error: check that mypy
    sees each."""
    source = tmp_path / "wrong.py"
    source.write_text(
        textwrap.dedent(
            """
            from statestore.store.lease_statements import Renew

            Renew(log_id="thr_1", token="t")
            Renew(log_id="thr_1", token="t", until_ms="soon")
            Renew("thr_1", "t", 5)
            """
        )
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-error-summary", "--follow-imports=silent", str(source)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert 'wrong.py:4: error: Missing named argument "until_ms"' in done.stdout, done.stdout + done.stderr
    assert 'wrong.py:5: error: Argument "until_ms" to "Renew" has incompatible type "str"' in done.stdout, done.stdout
    assert "wrong.py:6: error: Too many positional arguments" in done.stdout, done.stdout  # keyword-only: by name


# Statements written once, as Core, for both databases: PostgreSQL runs each compiled for asyncpg (`.pg`), SQLite
# through Core.
WRITTEN_ONCE = {
    "statestore.store.response_statements.RUN_ITEMS",
    "statestore.store.response_statements.GET_RESPONSE",
    "statestore.store.response_statements.CHAIN_CONTEXT",
    "statestore.store.response_statements.LOAD_CONVERSATION",
    "statestore.store.response_statements.POINTED_ITEMS",
    "statestore.store.thread_commit.COMMIT_THREAD_TURN",
    "statestore.store.response_commit.INSERT_RESPONSE",
    "statestore.store.response_commit.COMMIT_CONVERSATION_TURN",
    "statestore.store.response_commit.APPEND_ITEMS",
    "statestore.store.lease_statements.TAKE_THREAD_BY_RESPONSE",
    "statestore.store.lease_statements.TAKE_CONVERSATION",
    "statestore.store.lease_statements.THREADS.renew",
    "statestore.store.lease_statements.THREADS.release",
    "statestore.store.lease_statements.CONVERSATIONS.renew",
    "statestore.store.lease_statements.CONVERSATIONS.release",
    "statestore.store.background_statements.ADMIT",
    "statestore.store.background_statements.END",
    "statestore.store.background_statements.KEEP_FOR_COMMIT",
    "statestore.store.background_statements.CLAIMABLE",
    "statestore.store.thread_repository.LOAD_CONTEXT",
}


def test_no_statement_is_written_for_postgresql_alone() -> None:
    """Every statement the store runs is written once, as Core: none is SQL text for PostgreSQL alone (a twin of a
    Core statement for SQLite), whether defined at a module's top level or built anywhere in statestore/."""
    defined = _defined_statements()
    named = dict(defined)
    for name in WRITTEN_ONCE:
        statement = named[name]
        assert isinstance(statement, CoreStatement) and statement.pg is not None, name
    compiled = {id(pg) for _, pg in _compiled(defined)}
    raw = sorted(name for name, s in defined if isinstance(s, PgStatement) and id(s) not in compiled)
    assert not raw, (
        f"statements written for PostgreSQL alone: {raw}; write each once, as CoreStatement(params, core, "
        "durable=...), run on PostgreSQL through its .pg"
    )
    package = Path(statestore.__file__).parent
    built = [
        f"{path.relative_to(package.parent)}:{node.lineno}"
        for path in package.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "PgStatement"
    ]
    assert not built, f"PostgreSQL-only SQL text built at {built}: write it as a CoreStatement"


def test_a_core_statement_compiles_once_for_asyncpg_binding_each_field_by_name() -> None:
    statement = CoreStatement(
        _Take,
        update(threads)
        .where(threads.c.id == core_param("thread_id"), threads.c.expires_ms > core_param("now_ms"))
        .values(lease_token=core_param("token"), lease_expires_ms=core_param("now_ms")),
        durable=False,
    )
    pg = statement.on_pg()
    assert not pg.durable
    assert pg.sql.startswith("UPDATE threads SET lease_token=$")
    assert sorted(pg.names) == ["now_ms", "thread_id", "token"]  # a name used twice is one parameter
    assert pg.bind(_Take(thread_id="thr_1", now_ms=5, token="t")) == tuple(
        {"thread_id": "thr_1", "now_ms": 5, "token": "t"}[name] for name in pg.names
    )
    with pytest.raises(TypeError, match="Core only"):
        CoreStatement(_Take, statement.statement).on_pg()
