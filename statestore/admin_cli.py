"""`statestore admin …` and `statestore purge`: the admin operations from a shell, calling the same AdminService as
`/admin/v1`. Output is for people; `--json` prints the API's JSON for scripts. Their command lines are
statestore/admin_parser.py's; each names its operation here (OPERATIONS)."""

from __future__ import annotations

import argparse
import asyncio
import getpass
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from datetime import UTC, datetime
from typing import Any

import orjson
from sqlalchemy.exc import SQLAlchemyError

from statestore.admin import (
    AdminService,
    as_dict,
    day_label,
    erasure_fields,
    iso_time,
    passthrough_warning,
    purged_fields,
)
from statestore.admin_parser import CLEAR
from statestore.admin_setup import build_admin
from statestore.config import Settings
from statestore.errors import StatestoreError
from statestore.storage_setup import open_storage
from statestore.store.engine import create_engine
from statestore.store.erasure_log import ErasureState

Operation = Callable[[AdminService, argparse.Namespace], Awaitable[tuple[Any, str]]]


@asynccontextmanager
async def admin_service(settings: Settings) -> AsyncIterator[AdminService]:
    # The server's own wiring of the admin (statestore/admin_setup.py), with small pools and no policy cache: none of
    # the doors, backend clients and metrics the server builds around it (statestore/resources.py).
    async with AsyncExitStack() as stack:
        yield build_admin(settings, open_storage(settings, stack, pool_size=2), serving=False).admin


def _actor(args: argparse.Namespace) -> str:
    return str(args.actor or f"cli:{getpass.getuser()}")


def _time(ms: int | None) -> str:
    if ms is None:
        return "-"
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    if not rows:
        return "(none)"
    cells = [[str(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


# -- operations: each returns (json value, human text) -------------------------------------------------------


async def tenants_list(admin: AdminService, args: argparse.Namespace) -> tuple[Any, str]:
    rows = [as_dict(t) for t in await admin.tenants()]
    shown = [{**r, "created": _time(r["created_ms"])} for r in rows]
    return {"data": rows}, _table(shown, ["id", "name", "disabled", "created"])


async def tenants_create(admin: AdminService, args: argparse.Namespace) -> tuple[Any, str]:
    tenant = await admin.create_tenant(args.name, actor=_actor(args))
    return as_dict(tenant), f"created tenant {tenant.name} ({tenant.id})"


async def tenants_show(admin: AdminService, args: argparse.Namespace) -> tuple[Any, str]:
    tenant = await admin.tenant(args.tenant)
    stats = await admin.stats(tenant.id)
    text = f"{tenant.name} ({tenant.id}){' DISABLED' if tenant.disabled else ''}, created {_time(tenant.created_ms)}\n"
    text += "\n".join(f"  {k}: {v}" for k, v in stats.items())
    return {**as_dict(tenant), "stats": stats}, text


async def tenants_disable(admin: AdminService, args: argparse.Namespace) -> tuple[Any, str]:
    tenant = await admin.set_tenant_disabled(args.tenant, True, actor=_actor(args))
    return as_dict(tenant), f"disabled {tenant.name}: its keys are refused until it is enabled again"


async def tenants_enable(admin: AdminService, args: argparse.Namespace) -> tuple[Any, str]:
    tenant = await admin.set_tenant_disabled(args.tenant, False, actor=_actor(args))
    return as_dict(tenant), f"enabled {tenant.name}"


async def keys_list(admin: AdminService, args: argparse.Namespace) -> tuple[Any, str]:
    rows = [as_dict(k) for k in await admin.keys(args.tenant)]
    shown = [{**r, "created": _time(r["created_ms"]), "revoked": _time(r["revoked_ms"])} for r in rows]
    return {"data": rows}, _table(shown, ["id", "prefix", "label", "created", "revoked"])


async def keys_create(admin: AdminService, args: argparse.Namespace) -> tuple[Any, str]:
    created = await admin.create_key(args.tenant, label=args.label, actor=_actor(args))
    text = (
        f"created key {created.key.id} for tenant {created.key.tenant_id}\n\n  {created.secret}\n\n"
        "This is the only time the key is shown: store it now."
    )
    return {**as_dict(created.key), "secret": created.secret}, text


async def keys_revoke(admin: AdminService, args: argparse.Namespace) -> tuple[Any, str]:
    key = await admin.revoke_key(args.key_id, actor=_actor(args))
    return as_dict(key), f"revoked {key.id} ({key.prefix}…)"


async def policy_show(admin: AdminService, args: argparse.Namespace) -> tuple[Any, str]:
    policy, source = await admin.policy(args.scope)
    values = as_dict(policy)
    text = f"policy for {args.scope} (from {source}):\n" + "\n".join(f"  {k}: {v}" for k, v in values.items())
    return {"scope": args.scope, "source": source, "policy": values}, text


async def policy_set(admin: AdminService, args: argparse.Namespace) -> tuple[Any, str]:
    current, _ = await admin.policy(args.scope)
    values = as_dict(current)
    for name in values:
        given = getattr(args, name)
        if given is not None:
            values[name] = None if given is CLEAR else given
    policy = await admin.put_policy(args.scope, values, actor=_actor(args))
    text = f"policy for {args.scope} set:\n" + "\n".join(f"  {k}: {v}" for k, v in as_dict(policy).items())
    return {"scope": args.scope, "policy": as_dict(policy)}, text


async def policy_delete(admin: AdminService, args: argparse.Namespace) -> tuple[Any, str]:
    await admin.delete_policy(args.scope, actor=_actor(args))
    return {"scope": args.scope, "deleted": True}, f"{args.scope} now follows the default policy"


async def audit(admin: AdminService, args: argparse.Namespace) -> tuple[Any, str]:
    entries, _ = await admin.audit(
        limit=args.limit, before_id=None, actor=args.by, action=args.action, tenant=args.tenant
    )
    rows = [as_dict(e) for e in entries]
    shown = [{**r, "when": _time(r["at_ms"])} for r in rows]
    return {"data": rows}, _table(shown, ["id", "when", "actor", "action", "target"])


async def erase(admin: AdminService, args: argparse.Namespace) -> tuple[Any, str]:
    # Run to its end here: the erasure lasts as long as this process.
    state = await admin.erase(actor=_actor(args), tenant=args.tenant, user_id=args.user_id)
    return erasure_fields(state), f"{state.id}: {_erasure_said(state)}"


async def erasure(admin: AdminService, args: argparse.Namespace) -> tuple[Any, str]:
    state = await admin.erasure(args.id)
    return erasure_fields(state), f"{state.id}: {_erasure_said(state)}"


def _erasure_said(state: ErasureState) -> str:
    runs = f"{state.attempts} attempt" + ("s" if state.attempts != 1 else "")
    if state.status == "failed" and state.retry_at_ms is not None:
        return f"failed after {runs}, to be retried from {iso_time(state.retry_at_ms)} (by any server)"
    if state.status == "failed":
        return f"failed for good after {runs} (send it again: erasing is idempotent)"
    if state.erased is None:
        return state.status + (f" (attempt {state.attempts})" if state.attempts > 1 else "")
    erased = state.erased
    said = f"{erased.threads} threads, {erased.responses} responses and {erased.conversations} conversations"
    return f"done: erased {said} (database rows and cache entries)"


# The stats as people read them: each door's counts under its name, then the purger's last run.
_STATS_SECTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "messages door (threads, sessions)",
        (
            "live_threads",
            "live_messages",
            "live_bytes",
            "expired_awaiting_purge",
            "purged_threads_total",
            "erased_threads_total",
        ),
    ),
    (
        "responses door (responses, conversations)",
        (
            "live_responses",
            "live_conversations",
            "expired_responses_awaiting_purge",
            "expired_conversations_awaiting_purge",
            "purged_responses_total",
            "erased_responses_total",
            "purged_conversations_total",
            "erased_conversations_total",
        ),
    ),
)


def _stats_text(values: dict[str, Any]) -> str:
    lines: list[str] = []
    for title, names in _STATS_SECTIONS:
        lines.append(f"{title}:")
        lines += [f"  {name}: {values[name]}" for name in names]
    lines.append(f"purger last ran: {values['purger_last_run_at'] or 'never'}")
    return "\n".join(lines)


async def stats(admin: AdminService, args: argparse.Namespace) -> tuple[Any, str]:
    values = await admin.stats(args.tenant)
    return values, _stats_text(values)


async def usage(admin: AdminService, args: argparse.Namespace) -> tuple[Any, str]:
    days = [{**as_dict(d), "day": day_label(d.day)} for d in await admin.daily_usage(args.days)]
    shown = [
        {**d, **{f"{door} {what}": counts[what] for door, counts in d["doors"].items() for what in ("turns", "bytes")}}
        for d in days
    ]
    columns = ["day", "turns", "bytes", "messages turns", "messages bytes", "responses turns", "responses bytes"]
    note = "\n(messages: threads and sessions; responses: responses and conversations)"
    return {"data": days}, _table(shown, columns) + note


async def purge(admin: AdminService, args: argparse.Namespace) -> tuple[Any, str]:
    purged = await admin.purge(actor=_actor(args))
    text = (
        f"purged {purged.threads} expired threads, {purged.responses} responses and "
        f"{purged.conversations} conversations"
    )
    return purged_fields(purged), text


async def _database_problem(settings: Settings, error: BaseException) -> str:
    """What to tell the operator when an operation failed in the database: most often the schema is missing or old,
    or the database is out of reach."""
    # Only on failure: Alembic is slow to import, and every admin command would pay for it.
    from statestore.store.migrate import pending_revision  # noqa: PLC0415

    engine = create_engine(settings.database_url, pool_size=1)
    try:
        pending = await pending_revision(engine)
    except (SQLAlchemyError, OSError) as exc:
        return f"cannot reach the database ({type(exc).__name__}: {exc})"
    finally:
        await engine.dispose()
    if pending is not None:
        return f"{pending}. Run `statestore migrate` first."
    return f"the database refused the operation ({type(error).__name__}: {error})"


# Each operation by the name its command line gives (statestore/admin_parser.py).
OPERATIONS: dict[str, Operation] = {
    operation.__name__: operation
    for operation in (
        tenants_list,
        tenants_create,
        tenants_show,
        tenants_disable,
        tenants_enable,
        keys_list,
        keys_create,
        keys_revoke,
        policy_show,
        policy_set,
        policy_delete,
        audit,
        erase,
        erasure,
        stats,
        usage,
        purge,
    )
}


def run(settings: Settings, args: argparse.Namespace) -> None:
    operation = OPERATIONS[args.operation]

    async def main() -> tuple[Any, str]:
        async with admin_service(settings) as admin:
            return await operation(admin, args)

    try:
        value, text = asyncio.run(main())
    except StatestoreError as exc:
        sys.exit(f"statestore: {exc.message}")
    except (SQLAlchemyError, OSError) as exc:
        sys.exit(f"statestore: {asyncio.run(_database_problem(settings, exc))}")
    if args.json:
        sys.stdout.write(orjson.dumps(value, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print(text)
    if (warning := _mode_warning(settings, args)) is not None:
        own = "this command read STATESTORE_AUTH_MODE from its own environment: give it the server's setting"
        print(f"statestore: warning: {warning} ({own})", file=sys.stderr)


def _mode_warning(settings: Settings, args: argparse.Namespace) -> str | None:
    """Tenants, keys and tenant policies do nothing in passthrough mode: say so when one is created or set."""
    operation = args.operation
    if operation == "tenants_create":
        return passthrough_warning(settings.auth_mode, "tenants")
    if operation == "keys_create":
        return passthrough_warning(settings.auth_mode, "API keys")
    if operation == "policy_set" and args.scope != "default":
        return passthrough_warning(settings.auth_mode, "tenant policies")
    return None
