"""A Redis key prefix of a test's own: the Redis server is shared, so a test touches only keys it made."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager

import redis


def drop_prefix(redis_url: str, prefix: str) -> None:
    """Delete every key under `prefix` (SCAN + DEL in batches), and nothing else."""
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=prefix + "*", count=1000))
        for start in range(0, len(keys), 1000):
            client.delete(*keys[start : start + 1000])
    finally:
        client.close()


@contextmanager
def own_redis_prefix(redis_url: str) -> Iterator[str]:
    """A fresh `sstest:<hex>:` prefix; its keys are deleted when the block ends."""
    prefix = f"sstest:{secrets.token_hex(6)}:"
    try:
        yield prefix
    finally:
        drop_prefix(redis_url, prefix)
