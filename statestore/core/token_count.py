"""What a token count over stored context answers with, on both doors (docs/protocol.md §11, docs/responses.md): the
number, and a header naming who counted it, the backend's own tokenizer or statestore's estimator (the context
planner's, core/planner.py), so a client knows how far to trust it."""

from __future__ import annotations

from typing import Literal

TOKEN_COUNT_HEADER = b"statestore-token-count"
CountSource = Literal["backend", "estimate"]


def count_header(source: CountSource) -> tuple[bytes, bytes]:
    return (TOKEN_COUNT_HEADER, source.encode())
