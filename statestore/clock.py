"""The server's clock, in integer milliseconds. Expiry, leases and purge read it, never the database's `now()`, so
every process agrees and tests can move time without sleeping."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

Clock = Callable[[], int]


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


class OffsetFileClock:
    """Wall time plus an offset in seconds read from a file (missing or empty: 0). For tests only: the test writes
    the file to move every statestore process's clock forward at once."""

    def __init__(self, path: Path) -> None:
        self._path = path

    def __call__(self) -> int:
        try:
            text = self._path.read_text().strip()
        except FileNotFoundError:
            text = ""
        offset_ms = int(float(text) * 1000) if text else 0
        return wall_clock_ms() + offset_ms


def clock_from(offset_file: Path | None) -> Clock:
    return OffsetFileClock(offset_file) if offset_file is not None else wall_clock_ms
