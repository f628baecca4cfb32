"""Random base62 keys for ids: one getrandom call per key, drawn through a translation table in C."""

from __future__ import annotations

import os

ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"

# 248 = 4 x 62: a byte below it maps to ALPHABET[byte % 62] with every character equally likely (5.95 bits each);
# the eight bytes above it are dropped, never folded in, so nothing is biased.
_USABLE = 248
_TABLE = bytes(ord(ALPHABET[byte % 62]) if byte < _USABLE else 0 for byte in range(256))
_DROPPED = bytes(range(_USABLE, 256))


def random_key(length: int) -> str:
    """`length` base62 characters, each uniform over the alphabet from the system's CSPRNG."""
    # 3 % of bytes are dropped on average; drawing 1/8 more makes a second draw rare, and the loop covers it.
    drawn = os.urandom(length + length // 8 + 2).translate(_TABLE, _DROPPED)
    while len(drawn) < length:
        drawn += os.urandom(length).translate(_TABLE, _DROPPED)
    return drawn[:length].decode("ascii")
