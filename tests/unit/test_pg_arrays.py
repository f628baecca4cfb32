"""store/pg_arrays.py finds the names it sets in the asyncpg installed: an asyncpg without them would silently cost
every turn its ABC checks again."""

from __future__ import annotations

from asyncpg.protocol import protocol

from statestore.store import pg_arrays


def test_asyncpgs_array_encoder_takes_the_concrete_types() -> None:
    assert pg_arrays.install()
    assert protocol.IterableABC is pg_arrays.ARRAY_TYPES
    assert protocol.SizedABC is pg_arrays.ARRAY_TYPES
    assert protocol.MappingABC is pg_arrays.MAPPING_TYPES
