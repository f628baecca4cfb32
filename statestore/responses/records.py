"""What a stored response records of its turn's context (PROTOCOL §9), shared by both SQL paths (store.py and
pg_statements.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ContextRecord:
    """What a turn stores of its context (ResponseRow's context_* fields): a head is stored only on the response
    whose turn made it (head_id names that response, its own id included); its descendants name it."""

    tokens: int = 0
    counted_bytes: int = 0
    kept: int | None = None
    head_id: str | None = None
    head: bytes | None = None
