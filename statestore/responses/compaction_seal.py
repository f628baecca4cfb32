"""The `encrypted_content` of a compaction item (docs/responses.md, "Compaction"): the summary sealed for its owner, so
a client holding no state can carry it and send it back, and nobody (another owner included) can read or forge one.

The ring is STATESTORE_COMPACTION_KEYS, newest first. Behind it, whenever STATESTORE_OWNER_SECRET is set, comes a key
derived from that secret: a deployment that sets no keys still seals with a key that is stable across restarts and
replicas, and one that later sets keys still opens what the derived key sealed. With neither, compaction is
unavailable (a 400 saying which setting it needs), never sealed under a key made up for one process."""

from __future__ import annotations

from statestore.config import Settings
from statestore.sealing import Sealer, Unsealable, derived_key, parse_keys

DERIVED_KEY_ID = "owner-secret"
_PURPOSE = b"statestore compaction summary key v1"
_ASSOCIATED = b"statestore compaction v1\x00"  # then the owner: a value opens for the owner it was sealed for


class CompactionSeal:
    __slots__ = ("_sealer",)

    def __init__(self, sealer: Sealer) -> None:
        self._sealer = sealer

    def seal(self, summary: str, owner: str) -> str:
        return self._sealer.seal(summary.encode(), _ASSOCIATED + owner.encode())

    def open(self, value: str, owner: str) -> str:
        """The summary; Unsealable when `value` was not sealed here for `owner`."""
        plaintext = self._sealer.open(value, _ASSOCIATED + owner.encode())
        try:
            return plaintext.decode()
        except UnicodeDecodeError:
            raise Unsealable("not a summary") from None


def compaction_seal(settings: Settings) -> CompactionSeal | None:
    """The seal these settings give, or None when they give no key."""
    keys = parse_keys(settings.compaction_keys.get_secret_value()) if settings.compaction_keys else []
    derivable = settings.owner_secret is not None and settings.owner_secret.get_secret_value()
    if derivable and settings.owner_secret is not None and all(k.key_id != DERIVED_KEY_ID for k in keys):
        keys.append(derived_key(settings.owner_secret.get_secret_value(), DERIVED_KEY_ID, _PURPOSE))
    return CompactionSeal(Sealer(keys)) if keys else None
