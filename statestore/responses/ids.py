"""Ids of the Responses front door: a prefix and 32 random base62 characters (≈190 bits), unguessable."""

from __future__ import annotations

from statestore.base62 import random_key

_KEY_LEN = 32
PREFIXES = ("resp_", "msg_", "fc_", "conv_", "call_", "rs_", "cmp_", "item_")


def new_id(prefix: str) -> str:
    return prefix + random_key(_KEY_LEN)


def looks_like(prefix: str, text: object) -> bool:
    """Whether `text` could be an id statestore minted with this prefix (checked before any lookup)."""
    if not isinstance(text, str) or not text.startswith(prefix):
        return False
    key = text[len(prefix) :]
    # ASCII letters and digits are exactly the base62 alphabet: two C-level tests, not a loop per character.
    return len(key) == _KEY_LEN and key.isascii() and key.isalnum()
