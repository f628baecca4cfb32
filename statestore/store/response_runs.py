"""Where a chained response's context lies in response_items, so that a branch from any response, at any depth, reads
exactly its items in one indexed read (revision 0013).

A run is a path of responses whose items take consecutive positions under one run key (response_items.run_id,
run_position). A child continues its parent's run when nothing is stored past the parent's end in it yet (a
continue), else it starts a run of its own (a branch: regenerate, edit). A response's context is then a prefix of each
run along its path; its `context_runs` lists them, with the count of the path's items and a fingerprint of the path's
response ids. A read of those prefixes is only used when it matches both: a deleted ancestor, two children that took
one run at once, a run key met twice, anything but exactly the path, and the rebuild walks the parents instead
(store/response_store.py chain_segments), as for a response stored before this revision.

The commit writes one column more on the response and two on each item, and decides between continuing and starting a
run in its own statement (no round trip more); the decision's one index probe is on the index the read uses.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Iterable, Sequence
from itertools import groupby
from operator import itemgetter
from typing import Any, TypeAlias

from statestore.records import record

_HEAD = struct.Struct("<16sI")  # fingerprint, items
_RUN = struct.Struct("<qI")  # run key, end position
# A row of a read of the runs: (response id, kind, rendering), an asyncpg Record or a SQLAlchemy Row as read (a
# branch at depth reads thousands: they are not copied into tuples first).
Row: TypeAlias = Sequence[Any]


@record
class Runs:
    """A response's `context_runs`, decoded (encoded: `_HEAD`, then a `_RUN` for each run; `place` writes it)."""

    fingerprint: bytes
    items: int
    runs: tuple[tuple[int, int], ...]  # (run key, end): the run's positions [0, end) are on the path

    @property
    def keys(self) -> list[int]:
        return [key for key, _ in self.runs]

    @property
    def ends(self) -> list[int]:
        return [end for _, end in self.runs]


def decode(stored: bytes) -> Runs:
    fingerprint, items = _HEAD.unpack_from(stored)
    runs = tuple(_RUN.unpack_from(stored, offset) for offset in range(_HEAD.size, len(stored), _RUN.size))
    return Runs(fingerprint, items, runs)


def fingerprint(parent: bytes, response_id: str) -> bytes:
    """The path's fingerprint, one response further."""
    return hashlib.blake2b(parent + response_id.encode(), digest_size=16).digest()


def path_fingerprint(response_ids: Iterable[str]) -> bytes:
    """`fingerprint` along the path; a branch at depth D checks D + 1 of them, so the loop calls the hash itself."""
    blake2b = hashlib.blake2b
    found = b""
    for response_id in response_ids:
        found = blake2b(found + response_id.encode(), digest_size=16).digest()
    return found


@record
class Placement:
    """The two places a new response's items may take; the commit takes the first unless its run is taken past
    `extend_from` (then the second). All None: the items go in no run (the response's context is walked)."""

    extend_run: int | None = None
    extend_from: int | None = None
    extended: bytes | None = None
    new_run: int | None = None
    started: bytes | None = None


def place(parent_runs: bytes | None, *, is_root: bool, response_id: str, count: int) -> Placement:
    """Where the items of a new chained response go: `parent_runs` is its parent's `context_runs` (None for a root,
    or a parent stored without them). A response without items would leave no trace of itself in a read, so its
    descendants walk."""
    if count == 0 or (parent_runs is None and not is_root):
        return Placement()
    # 63 random bits: two runs sharing a key only make their readers walk (the fingerprint tells). Drawn in C:
    # secrets.randbits runs SystemRandom's Python on every turn.
    new_run = int.from_bytes(os.urandom(8)) >> 1
    if parent_runs is None:
        started = _HEAD.pack(fingerprint(b"", response_id), count) + _RUN.pack(new_run, count)
        return Placement(new_run=new_run, started=started)
    # Both placements are the parent's encoding with a new head, then its runs with the last extended, or with a
    # run added: written from its bytes, not decoded into Runs and encoded again (this is on every turn).
    parent_mark, parent_items = _HEAD.unpack_from(parent_runs)
    head = _HEAD.pack(fingerprint(parent_mark, response_id), parent_items + count)
    last = len(parent_runs) - _RUN.size
    last_key, last_end = _RUN.unpack_from(parent_runs, last)
    extended = b"".join((head, parent_runs[_HEAD.size : last], _RUN.pack(last_key, last_end + count)))
    started = b"".join((head, parent_runs[_HEAD.size :], _RUN.pack(new_run, count)))
    return Placement(last_key, last_end, extended, new_run, started)


def segments_of(runs: Runs, rows: Sequence[Row], depth: int) -> list[list[tuple[str, bytes]]] | None:
    """The (kind, rendering) of each response's items, oldest first, from the read of `runs`' prefixes (rows of
    response id, kind, rendering in path order, as the driver returns them); None unless they are exactly the path's
    items."""
    if len(rows) != runs.items:
        return None
    ids: list[str] = []
    segments: list[list[tuple[str, bytes]]] = []
    for response_id, items in groupby(rows, key=itemgetter(0)):
        ids.append(response_id)
        segments.append([(item[1], item[2]) for item in items])
    if len(ids) != depth + 1 or path_fingerprint(ids) != runs.fingerprint:
        return None
    return segments
