"""asyncpg's array encoder, told which values are arrays by their type instead of by collections.abc.

Before asyncpg encodes an array parameter it asks `isinstance(value, Iterable)` and `isinstance(value, Sized)` of the
array and again of each element, and `isinstance(value, Mapping)` of the array, against collections.abc's classes:
each such check runs `ABCMeta.__instancecheck__` in Python, about 1,700 instructions. A Responses continue binds four
arrays (its items' ids, bodies, kinds and renderings) and asks 32 of them: 55k of its 1.21M instructions (4.5 %,
counted by callgrind); a threaded continue 28.

statestore binds every array as a list (a tuple at the top is taken too, and a tuple inside an array stays a record, as
asyncpg has it) and no composite value (whose encoder asks the same Mapping question of a record given as a dict), so
the names asyncpg's encoders look up are given concrete types, which `isinstance` answers in C. A value of any other
type bound as an array is refused, as a string is today ("a sized iterable container expected"). asyncpg reads these
names from its module on every call, so setting them once takes effect everywhere in the process, SQLAlchemy's asyncpg
connections included; tests/unit/test_pg_arrays.py fails if a new asyncpg release no longer has them.
"""

from __future__ import annotations

from asyncpg.protocol import protocol as _protocol

ARRAY_TYPES = (list, tuple)
MAPPING_TYPES = (dict,)
_TYPES = {"IterableABC": ARRAY_TYPES, "SizedABC": ARRAY_TYPES, "MappingABC": MAPPING_TYPES}


def install() -> bool:
    """Give asyncpg's encoders the concrete types; False (nothing changed) if this asyncpg has no such names."""
    if not all(hasattr(_protocol, name) for name in _TYPES):
        return False
    for name, types in _TYPES.items():
        setattr(_protocol, name, types)
    return True
