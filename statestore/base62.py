"""Random base62 keys for ids: one getrandom call per key, not one per character."""

from __future__ import annotations

import secrets

ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def random_key(length: int) -> str:
    """`length` base62 characters from at least 5.95 random bits each (plus 8 bits of slack against bias)."""
    value = int.from_bytes(secrets.token_bytes((length * 6 + 7) // 8 + 1))
    chars = []
    for _ in range(length):
        value, digit = divmod(value, 62)
        chars.append(ALPHABET[digit])
    return "".join(chars)
