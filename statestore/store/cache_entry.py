"""What a cache entry is, apart from where it is kept: whose context it holds (CacheKey), what it holds
(CachedHistory), and how its count is written in Redis, the format both releases of a rolling upgrade read."""

from __future__ import annotations

from typing import Literal, NamedTuple

CacheKind = Literal["thread", "response", "conversation"]
# The stored name of each kind's entry: a thread's own id, a response's (the chain ending at it) and a conversation's
# under a prefix. The names of the releases before: an invalidation by either release reaches the other's entries.
_NAME_PREFIX: dict[str, str] = {"thread": "", "response": "resp:", "conversation": "conv:"}


class CacheKey(NamedTuple):
    """Whose context an entry holds."""

    kind: CacheKind
    id: str

    @property
    def name(self) -> str:
        return _NAME_PREFIX[self.kind] + self.id

    def __str__(self) -> str:
        return self.name


def thread_key(thread_id: str) -> CacheKey:
    return CacheKey("thread", thread_id)


def response_key(response_id: str) -> CacheKey:
    return CacheKey("response", response_id)


def conversation_key(conversation_id: str) -> CacheKey:
    return CacheKey("conversation", conversation_id)


class CachedHistory(NamedTuple):
    # The ignore: the field shadows tuple.count(), which nobody calls on this type; the name is the API.
    count: int  # type: ignore[assignment]  # number of messages joined in `joined`
    joined: bytes  # b",".join(message_bytes); b"" when count == 0
    # What the entry was read against besides its count (a chain begun on a conversation: the conversation's
    # version); an entry is served only for the version it was written with. BRANCH_POINT: a response's entry kept
    # for its branches.
    version: int | None = None
    # How many sealed frames the entry was read from (0 for a clear entry): a reader that meets many rewrites the
    # entry as one frame, so a long thread's hot read opens few values (store/sealed_cache.py).
    frames: int = 0


# A response's entry kept for its branches: its chain's context, written when a turn branched from it (its context was
# read from the database), kept when later turns branch from it again, never moved to a child. Written as a version no
# conversation has (versions are positions, or -1 for a chain whose conversation is gone), so a release that does not
# know it reads the entry as another version's: a miss.
BRANCH_POINT = -2

# Each entry's count key carries the format it was written in: b"2:<count>" or b"2:<count>:<version>". Releases
# before formats were written stored a bare count (format 1, the same meaning for a thread's or a conversation's
# entry), which is still read; a format this code does not know is a miss. So replicas of two releases can share one
# Redis during a rolling upgrade: each serves only what it can read, and writes under the same keys, so an
# invalidation by either reaches the other's entries. The Redis scripts (store/cache_scripts.py) compare counts as
# these exact strings: an entry of another format (or version) never matches, and is dropped instead of appended to.
CACHE_FORMAT = 2
_FORMAT_PREFIX = b"2:"


def encode_count(count: int, version: int | None = None) -> bytes:
    return _encoded(_FORMAT_PREFIX, count, version)


def decode_count(raw: bytes) -> tuple[int, int | None] | None:
    """(count, version) of a count key's value, or None for a value this code cannot read."""
    if not raw.startswith(_FORMAT_PREFIX):
        return (int(raw), None) if raw.isdigit() else None  # format 1
    return _decoded(raw[len(_FORMAT_PREFIX) :])


def _encoded(prefix: bytes, count: int, version: int | None) -> bytes:
    return prefix + (b"%d" % count if version is None else b"%d:%d" % (count, version))


def _decoded(fields_text: bytes) -> tuple[int, int | None] | None:
    fields = fields_text.split(b":")
    try:
        if len(fields) == 1:
            return int(fields[0]), None
        if len(fields) == 2:
            return int(fields[0]), int(fields[1])
    except ValueError:
        pass
    return None


# A sealed entry (encryption on, store/sealed_cache.py) is written in format 3: b"3:<count>" or b"3:<count>:<version>",
# and its bytes are frames, not joined messages. A clear cache reads formats 1 and 2 only and a sealed one format 3
# only, so a replica without keys never serves a sealed entry and a replica with keys never serves a clear one; the
# scripts compare counts exactly, so an append or move across families drops the entry (a miss).
SEALED_FORMAT = 3
_SEALED_PREFIX = b"3:"


def encode_sealed_count(count: int, version: int | None = None) -> bytes:
    return _encoded(_SEALED_PREFIX, count, version)


def decode_sealed_count(raw: bytes) -> tuple[int, int | None] | None:
    """(count, version) of a sealed entry's count, or None for any other format."""
    return _decoded(raw[len(_SEALED_PREFIX) :]) if raw.startswith(_SEALED_PREFIX) else None


def appended(joined: bytes, added: list[bytes]) -> bytes:
    """An entry's joined messages with `added` after them (both stores append this way)."""
    # One join builds the result in a single allocation; `joined + b"," + ...` would copy history twice.
    return b",".join([joined, *added]) if joined else b",".join(added)
