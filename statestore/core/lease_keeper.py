"""Keeping a turn's lease while its reply runs long.

A lease is short so that a crashed request frees its thread soon; a live request renews it from the moment it is
taken, so a summary request (docs/protocol.md §9) and then the reply may together outlast it. Most turns end well before
a third of it, so no task is started per turn: a timer fires only for a long one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

Renew = Callable[[], Awaitable[bool]]


class LeaseKeeper:
    """Renews one lease every `interval` seconds from `start()` until `stop()`, or until a renewal finds it lost."""

    __slots__ = ("_interval", "_renew", "_task", "_timer", "thread_id")

    def __init__(self, renew: Renew, interval: float, thread_id: str) -> None:
        self._renew = renew
        self._interval = interval
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None
        self.thread_id = thread_id

    def start(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(self._interval, self._begin)

    def _begin(self) -> None:
        self._timer = None
        self._task = asyncio.get_running_loop().create_task(self._keep(), name="lease-renewal")

    async def _keep(self) -> None:
        while True:
            try:
                if not await self._renew():
                    return
            except Exception as exc:  # a database hiccup: the lease still runs; try again at the next interval
                log.warning("could not renew a lease", extra={"thread_id": self.thread_id, "error": type(exc).__name__})
            await asyncio.sleep(self._interval)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is not None:
            self._task.cancel()
            self._task = None
