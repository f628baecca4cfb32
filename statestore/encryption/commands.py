"""`statestore admin encryption status|rotate`: the key store as an operator sees it, and the re-wrap of every data key
under the newest master key that lets an old master key be dropped (docs/encryption.md).

They work on the key store directly (and the content database's audit log), not through the server's wiring: neither
needs Redis or the backend, and rotation runs while the replicas serve."""

from __future__ import annotations

import argparse
import asyncio
import getpass
import sys
from typing import Any

import orjson
from sqlalchemy import inspect
from sqlalchemy.exc import SQLAlchemyError

from statestore.clock import clock_from
from statestore.command_setup import load_settings, require_database, safe_url
from statestore.config import Settings
from statestore.encryption.content import SealedContent
from statestore.encryption.master_keys import MasterKeyRing
from statestore.encryption.setup import content_keys
from statestore.store.admin_repository import AdminRepository
from statestore.store.engine import create_engine
from statestore.store.keystore import KeyStore

_OFF = (
    "encryption at rest is off (neither STATESTORE_ENCRYPTION_KEYS nor STATESTORE_ENCRYPTION_KEYS_FILE is set): there "
    "are no data keys to re-wrap"
)


def _keystore_url(settings: Settings) -> str:
    return settings.keystore_url or settings.database_url


async def _has_table(settings: Settings) -> bool:
    engine = create_engine(_keystore_url(settings), pool_size=1)
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(lambda sync: inspect(sync).has_table("data_keys"))
    finally:
        await engine.dispose()


async def status(settings: Settings) -> tuple[dict[str, Any], str]:
    ring = settings.master_keys()
    where = safe_url(_keystore_url(settings))
    value: dict[str, Any] = {
        "enabled": ring is not None,
        "master_keys": ring.ids if ring is not None else [],
        "newest_master_key": ring.newest_id if ring is not None else None,
        "keystore": where,
        "keystore_separate": settings.keystore_url is not None,
        "data_keys": {},
        "problem": None,
    }
    if not await _has_table(settings):
        value["problem"] = "the key store has no data_keys table: run `statestore migrate`"
    else:
        engine = create_engine(_keystore_url(settings), pool_size=1)
        try:
            value["data_keys"] = await KeyStore(engine).count_by_master()
            value["problem"] = await content_keys(settings, engine, lambda: 0).start_problem()
        finally:
            await engine.dispose()
    return value, _status_text(value)


def _status_text(value: dict[str, Any]) -> str:
    if value["enabled"]:
        older = [m for m in value["master_keys"] if m != value["newest_master_key"]]
        ring = f"'{value['newest_master_key']}' (newest: wraps new data keys)"
        ring += "".join(f", '{m}'" for m in older)
        lines = ["encryption at rest: on", f"master keys: {ring}"]
    else:
        lines = ["encryption at rest: off (STATESTORE_ENCRYPTION_KEYS is not set): content is stored in clear"]
    separate = "the content database"
    if value["keystore_separate"]:
        separate = "a database of its own (STATESTORE_KEYSTORE_URL)"
    lines.append(f"key store: {value['keystore']} ({separate})")
    counts: dict[str, int] = value["data_keys"]
    if counts:
        lines.append(f"data keys: {sum(counts.values())}, by the master key wrapping them:")
        lines += [f"  {m}: {n}" for m, n in sorted(counts.items(), key=lambda item: -item[1])]
        stale = [m for m in counts if value["enabled"] and m != value["newest_master_key"]]
        if stale and value["problem"] is None:
            lines.append(
                f"  (under older master keys: {', '.join(sorted(stale))}; "
                "`statestore admin encryption rotate` moves them to the newest)"
            )
    else:
        lines.append("data keys: none")
    if value["problem"] is not None:
        lines.append(f"PROBLEM: {value['problem']}")
    return "\n".join(lines)


async def rotate(settings: Settings, ring: MasterKeyRing, *, actor: str, batch_size: int) -> tuple[dict[str, Any], str]:
    if not await _has_table(settings):
        raise _Refused("the key store has no data_keys table: run `statestore migrate` first")
    keystore_engine = create_engine(_keystore_url(settings), pool_size=1)
    content_engine = create_engine(settings.database_url, pool_size=1) if settings.keystore_url else keystore_engine
    try:
        keystore = KeyStore(keystore_engine)
        content = SealedContent(keystore, ring, clock=lambda: 0, remember_seconds=0)
        # A data key under a master key the ring lacks, or one that does not unwrap, would stop the rotation midway:
        # say so before the first batch.
        if (problem := await content.start_problem()) is not None:
            raise _Refused(problem)

        def progress(total: int) -> None:
            print(f"statestore: re-wrapped {total} data keys so far", file=sys.stderr)

        moved = await content.rotate(batch_size=batch_size, progress=progress)
        counts = await keystore.count_by_master()
        newest = ring.newest_id
        left = {m: n for m, n in counts.items() if m != newest}
        after = {"rewrapped": moved, "master_key": newest, "left_under_older": sum(left.values())}
        now_ms = clock_from(settings.clock_offset_file)()
        await AdminRepository(content_engine).record(
            actor=actor, action="encryption.rotate", target=newest, after=after, now_ms=now_ms
        )
    finally:
        await keystore_engine.dispose()
        if content_engine is not keystore_engine:
            await content_engine.dispose()
    text = f"re-wrapped {moved} data keys under master key '{newest}'"
    if left:
        # A replica still running with an older key first wraps its new scopes' keys under it.
        text += (
            f"; {sum(left.values())} are under older master keys ({', '.join(sorted(left))}), made meanwhile by a "
            "replica whose STATESTORE_ENCRYPTION_KEYS does not list the newest key first: restart it, then run this "
            "again"
        )
    else:
        older = [m for m in ring.ids if m != newest]
        if older:
            names = ", ".join(repr(m) for m in older)
            text += f"; no data key is wrapped under {names} now: drop it from the ring and restart the replicas"
    return {"data_keys": counts, **after}, text


class _Refused(Exception):
    pass


def _settings() -> Settings:
    settings = load_settings()
    require_database(settings)
    return settings


def _finish(value: dict[str, Any], text: str, args: argparse.Namespace) -> None:
    if args.json:
        sys.stdout.write(orjson.dumps(value, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print(text)


def cmd_status(args: argparse.Namespace) -> None:
    settings = _settings()
    try:
        value, text = asyncio.run(status(settings))
    except (SQLAlchemyError, OSError) as exc:
        sys.exit(f"statestore: cannot read the key store ({type(exc).__name__}: {exc})")
    _finish(value, text, args)
    if value["problem"] is not None:
        sys.exit(1)  # what a health script checks: the server would refuse to start


def cmd_rotate(args: argparse.Namespace) -> None:
    settings = _settings()
    ring = settings.master_keys()
    if ring is None:
        sys.exit(f"statestore: {_OFF}")
    actor = args.actor or f"cli:{getpass.getuser()}"
    try:
        value, text = asyncio.run(rotate(settings, ring, actor=actor, batch_size=args.batch_size))
    except _Refused as exc:
        sys.exit(f"statestore: {exc}")
    except (SQLAlchemyError, OSError) as exc:
        sys.exit(f"statestore: the rotation stopped; run it again ({type(exc).__name__}: {exc})")
    _finish(value, text, args)
