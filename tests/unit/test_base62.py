"""Random base62 keys (statestore/base62.py): the ids of threads, messages, responses and requests."""

from __future__ import annotations

from collections import Counter

from statestore.base62 import ALPHABET, random_key


def test_keys_have_the_length_asked_and_only_alphabet_characters() -> None:
    for length in (1, 8, 22, 24, 200):
        key = random_key(length)
        assert len(key) == length
        assert set(key) <= set(ALPHABET)


def test_every_character_is_equally_likely() -> None:
    """Bytes at or above 248 must be dropped, not folded in: folding would make the first eight characters 1.25
    times as likely as the others, far outside these bounds."""
    counts = Counter("".join(random_key(62) for _ in range(8_000)))
    expected = 8_000
    assert set(counts) == set(ALPHABET)
    assert all(0.9 * expected < count < 1.1 * expected for count in counts.values())


def test_keys_do_not_repeat() -> None:
    keys = {random_key(22) for _ in range(50_000)}
    assert len(keys) == 50_000
