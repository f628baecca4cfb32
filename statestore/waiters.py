"""Queues of futures that tasks wait on for a pooled resource (store/pg_pool.py, upstream/http1.py)."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any


def wake_first(waiters: deque[asyncio.Future[Any]]) -> None:
    """Wake the first task still waiting, with None (try again); a waiter cancelled meanwhile is skipped."""
    while waiters:
        waiter = waiters.popleft()
        if not waiter.done():
            waiter.set_result(None)
            return
