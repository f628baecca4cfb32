"""Statements bound by name (statestore/store/statement.py): every `$n` of a prepared statement is bound from exactly
one field of its parameter object, in the order asyncpg passes them; a statement whose SQL and parameter object
disagree fails where it is defined, at import; a Core statement is checked the same way."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from sqlalchemy import update

from statestore.store.schema import threads
from statestore.store.statement import (
    CoreStatement,
    PgStatement,
    core_param,
    core_values,
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
