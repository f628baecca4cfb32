"""Thread and response ids: random and unguessable, and a response id names its thread without a lookup.

A response id is `msg_` + the thread's 22-character key + 22 more random characters, so the thread row is found
by primary key; knowing a thread id does not let anyone forge a response id of it.
"""

from __future__ import annotations

import secrets

from statestore.base62 import random_key

_KEY_LEN = 22  # 22 base62 characters ≈ 131 bits
_THREAD_PREFIX = "thr_"
_MESSAGE_PREFIX = "msg_"


def _random_key() -> str:
    return random_key(_KEY_LEN)


def new_thread_id() -> str:
    return _THREAD_PREFIX + _random_key()


def new_response_id(thread_id: str) -> str:
    return _MESSAGE_PREFIX + thread_id.removeprefix(_THREAD_PREFIX) + _random_key()


def new_lease_token() -> str:
    return secrets.token_hex(16)


def _is_key(text: str) -> bool:
    # ASCII letters and digits are exactly the base62 alphabet; two C-level checks instead of a loop per character.
    return len(text) == _KEY_LEN and text.isascii() and text.isalnum()


def thread_of_response(response_id: str) -> str | None:
    """The thread id a response id belongs to, or None when the id is not one statestore minted."""
    if not response_id.startswith(_MESSAGE_PREFIX):
        return None
    body = response_id[len(_MESSAGE_PREFIX) :]
    if len(body) != 2 * _KEY_LEN or not _is_key(body[:_KEY_LEN]) or not _is_key(body[_KEY_LEN:]):
        return None
    return _THREAD_PREFIX + body[:_KEY_LEN]


def is_thread_id(text: str) -> bool:
    return text.startswith(_THREAD_PREFIX) and _is_key(text[len(_THREAD_PREFIX) :])
