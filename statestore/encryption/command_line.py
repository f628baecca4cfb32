"""The command lines of `statestore admin encryption status|rotate` (statestore/encryption/commands.py runs them).
Apart from the commands, which import the key store, SQLAlchemy and cryptography, so that building the parser for
`--help` or for another command does not."""

from __future__ import annotations

import argparse
from typing import Any


def _status(args: argparse.Namespace) -> None:
    from statestore.encryption.commands import cmd_status  # noqa: PLC0415

    cmd_status(args)


def _rotate(args: argparse.Namespace) -> None:
    from statestore.encryption.commands import cmd_rotate  # noqa: PLC0415

    cmd_rotate(args)


def _batch_size(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 10_000:
        raise argparse.ArgumentTypeError("between 1 and 10000")
    return value


def add_commands(groups: Any, common: argparse.ArgumentParser) -> None:
    """Register `admin encryption status|rotate` on the admin command's groups."""
    encryption = groups.add_parser(
        "encryption",
        help="encryption at rest: status of the keys, master key rotation",
        description="Encryption at rest (docs/encryption.md). Master keys come from "
        "STATESTORE_ENCRYPTION_KEYS (or _FILE) as 'id:key,id:key', newest first; the data keys they wrap live in the "
        "key store (STATESTORE_KEYSTORE_URL, or the content database).",
    )
    actions = encryption.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = actions.add_parser(
        "status",
        parents=[common],
        help="is encryption on; master key ids; data keys per master key; where the key store is",
        description="Show whether encryption at rest is on, the master key ids in the ring (never the keys), how many "
        "data keys each master key wraps, and where the key store is (its URL without a password). Exits 1 when the "
        "server would refuse to start with these keys (a master key missing or wrong, sealed content without keys).",
    )
    p.set_defaults(func=_status, operation=None)
    p = actions.add_parser(
        "rotate",
        parents=[common],
        help="re-wrap every data key under the newest master key (online; safe to run again)",
        description="Re-wrap every data key that is not under the newest master key (the first in "
        "STATESTORE_ENCRYPTION_KEYS) under it, in batches, while the servers run: the data keys themselves and the "
        "content sealed under them do not change. Run it after every replica was restarted with the new key first; "
        "when it reports no key left under the old master key, drop that key from the ring and restart the replicas. "
        "Safe to run twice, or on two machines at once. Audited as encryption.rotate.",
    )
    p.add_argument("--batch-size", type=_batch_size, default=500, help="data keys per transaction (default 500)")
    p.set_defaults(func=_rotate, operation=None)
