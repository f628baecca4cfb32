"""`statestore admin …` and `statestore purge`: the admin operations from a shell, calling the same AdminService as
`/admin/v1`. Output is for people; `--json` prints the API's JSON for scripts."""

from __future__ import annotations

import argparse
import asyncio
import getpass
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

import orjson
from sqlalchemy.exc import SQLAlchemyError

from statestore.admin import AdminService, as_dict, day_label, erasure_fields, passthrough_warning, purged_fields
from statestore.config import Settings
from statestore.errors import StatestoreError
from statestore.policy_fields import AUTO, POLICY_FIELDS
from statestore.resources import build_resources
from statestore.store.engine import create_engine
from statestore.store.erasure_log import ErasureState

Operation = Callable[[AdminService, argparse.Namespace], Awaitable[Any]]


@asynccontextmanager
async def admin_service(settings: Settings) -> AsyncIterator[AdminService]:
    # The server's own wiring, with small pools and no policy cache (statestore/resources.py).
    async with build_resources(settings, pool_size=2, serving=False) as resources:
        yield resources.admin


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
            values[name] = None if given is _NONE else given
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
    if state.erased is None:
        return state.status + (" (send it again: erasing is idempotent)" if state.status == "failed" else "")
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


def run(settings: Settings, args: argparse.Namespace) -> None:
    operation: Callable[[AdminService, argparse.Namespace], Awaitable[tuple[Any, str]]] = args.operation

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
    if operation is tenants_create:
        return passthrough_warning(settings.auth_mode, "tenants")
    if operation is keys_create:
        return passthrough_warning(settings.auth_mode, "API keys")
    if operation is policy_set and args.scope != "default":
        return passthrough_warning(settings.auth_mode, "tenant policies")
    return None


_NONE = object()


def _or_none(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """A flag whose value `none` clears a nullable field (argparse's None means "not given")."""

    def parse(value: str) -> Any:
        return _NONE if value == "none" else kind(value)

    parse.__name__ = getattr(kind, "__name__", "value")
    return parse


def _or_auto(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """A number flag that also takes `auto` (a window the backend states)."""

    def parse(value: str) -> Any:
        return AUTO if value == AUTO else kind(value)

    parse.__name__ = getattr(kind, "__name__", "value")
    return parse


def _switch(value: str) -> bool:
    """A true/false option, strictly: a typo must not switch threads off."""
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, not {value!r}")


def add_commands(commands: Any) -> None:
    """Register `admin …` and `purge` on the top-level subparsers."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print JSON instead of text")
    common.add_argument("--actor", help="name recorded in the audit log (default cli:<login>)")

    purge_cmd = commands.add_parser(
        "purge",
        parents=[common],
        help="delete expired threads, responses and conversations now",
        description="Delete every expired thread's, response tree's and conversation's rows and cache entries now "
        "(the server also does this every STATESTORE_PURGE_INTERVAL_SECONDS).",
    )
    purge_cmd.set_defaults(func=None, operation=purge)

    admin = commands.add_parser(
        "admin",
        help="tenants, API keys, retention policies, audit, erasure",
        description="Administer statestore directly on its database (the same operations as /admin/v1).",
    )
    groups = admin.add_subparsers(dest="group", required=True, metavar="GROUP")

    tenants = groups.add_parser("tenants", help="tenants").add_subparsers(dest="action", required=True)
    tenants.add_parser("list", parents=[common], help="list tenants").set_defaults(operation=tenants_list)
    p = tenants.add_parser("create", parents=[common], help="create a tenant")
    p.add_argument("name")
    p.set_defaults(operation=tenants_create)
    for name, op, text in (
        ("show", tenants_show, "show a tenant and its usage"),
        ("disable", tenants_disable, "refuse a tenant's keys"),
        ("enable", tenants_enable, "accept a tenant's keys again"),
    ):
        p = tenants.add_parser(name, parents=[common], help=text)
        p.add_argument("tenant", help="tenant id or name")
        p.set_defaults(operation=op)

    keys = groups.add_parser("keys", help="statestore API keys (keys mode)").add_subparsers(
        dest="action", required=True
    )
    p = keys.add_parser("list", parents=[common], help="list a tenant's keys (never the secrets)")
    p.add_argument("tenant", help="tenant id or name")
    p.set_defaults(operation=keys_list)
    p = keys.add_parser("create", parents=[common], help="create a key; the secret is shown once")
    p.add_argument("tenant", help="tenant id or name")
    p.add_argument("--label", help="a note to recognise the key by")
    p.set_defaults(operation=keys_create)
    p = keys.add_parser("revoke", parents=[common], help="revoke a key")
    p.add_argument("key_id")
    p.set_defaults(operation=keys_revoke)

    policy = groups.add_parser("policy", help="retention policies").add_subparsers(dest="action", required=True)
    p = policy.add_parser("show", parents=[common], help="the policy in force for 'default' or a tenant")
    p.add_argument("scope", help="'default' or a tenant id or name")
    p.set_defaults(operation=policy_show)
    p = policy.add_parser("set", parents=[common], help="change fields of a policy (others keep their values)")
    p.add_argument("scope", help="'default' or a tenant id or name")
    for field in POLICY_FIELDS:
        flag = "--" + field.name.replace("_", "-")
        if field.kind == "bool":
            p.add_argument(flag, type=_switch, metavar="true|false", help=field.help)
        elif field.kind == "choice":
            p.add_argument(flag, choices=field.choices, help=field.help)
        else:
            kind: Callable[[str], Any] = {"int": int, "ratio": float, "text": str}[field.kind]
            metavar = "TEXT" if field.kind == "text" else "N"
            if field.auto:
                kind, metavar = _or_auto(kind), f"{metavar}|{AUTO}"
            if field.nullable:
                kind, metavar = _or_none(kind), f"{metavar}|none"
            p.add_argument(flag, type=kind, metavar=metavar, help=field.help)
    p.set_defaults(operation=policy_set)
    p = policy.add_parser("delete", parents=[common], help="drop a tenant's override (it follows the default)")
    p.add_argument("scope")
    p.set_defaults(operation=policy_delete)

    p = groups.add_parser("audit", parents=[common], help="recent admin changes, newest first")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--by", help="only entries by this actor (an admin token's name, or cli:<login>)")
    p.add_argument("--action", help="only this action, or its prefix: policy, policy.put, key, tenant, erase")
    p.add_argument("--tenant", help="only entries about this tenant (id or name): it, its policy, keys, erasures")
    p.set_defaults(operation=audit)
    p = groups.add_parser(
        "erase", parents=[common], help="erase every thread, response and conversation of a tenant and/or a user_id"
    )
    p.add_argument("--tenant", help="tenant id or name")
    p.add_argument("--user-id", help="the metadata.user_id the threads, responses or conversations were created with")
    p.set_defaults(operation=erase)
    p = groups.add_parser(
        "erasure", parents=[common], help="an erasure's state (running, done, failed) and, once done, what it erased"
    )
    p.add_argument("id", help="the erasure's id (erasure_…), as `erase` or POST /admin/v1/erase gave it")
    p.set_defaults(operation=erasure)
    p = groups.add_parser(
        "stats", parents=[common], help="live, expired, purged and erased counts of both doors; the purger's last run"
    )
    p.add_argument("--tenant", help="tenant id or name")
    p.set_defaults(operation=stats)
    p = groups.add_parser(
        "usage", parents=[common], help="turns and bytes stored per UTC day, in all and by door, counted at commit"
    )
    p.add_argument("--days", type=int, default=30)
    p.set_defaults(operation=usage)
    p = groups.add_parser(
        "purge", parents=[common], help="delete expired threads, responses and conversations now (`statestore purge`)"
    )
    p.set_defaults(operation=purge)

    from statestore.encryption.commands import add_commands as add_encryption_commands  # noqa: PLC0415

    add_encryption_commands(groups, common)
