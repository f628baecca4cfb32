"""The command lines of `statestore admin …` and `statestore purge`: their arguments, their help, and the name of
the operation each runs (statestore/admin_cli.py). Apart from the operations, so that building the parser (for
`--help`, and before any command) imports no more than argparse and the policy's field definitions."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from statestore.encryption.command_line import add_commands as add_encryption_commands
from statestore.policy_fields import AUTO, POLICY_FIELDS

# What a nullable field's flag given as `none` parses to: clear the field.
CLEAR = object()


def _or_none(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """A flag whose value `none` clears a nullable field (argparse's None means "not given")."""

    def parse(value: str) -> Any:
        return CLEAR if value == "none" else kind(value)

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
    purge_cmd.set_defaults(func=None, operation="purge")

    admin = commands.add_parser(
        "admin",
        help="tenants, API keys, retention policies, audit, erasure",
        description="Administer statestore directly on its database (the same operations as /admin/v1).",
    )
    groups = admin.add_subparsers(dest="group", required=True, metavar="GROUP")

    tenants = groups.add_parser("tenants", help="tenants").add_subparsers(dest="action", required=True)
    tenants.add_parser("list", parents=[common], help="list tenants").set_defaults(operation="tenants_list")
    p = tenants.add_parser("create", parents=[common], help="create a tenant")
    p.add_argument("name")
    p.set_defaults(operation="tenants_create")
    for name, op, text in (
        ("show", "tenants_show", "show a tenant and its usage"),
        ("disable", "tenants_disable", "refuse a tenant's keys"),
        ("enable", "tenants_enable", "accept a tenant's keys again"),
    ):
        p = tenants.add_parser(name, parents=[common], help=text)
        p.add_argument("tenant", help="tenant id or name")
        p.set_defaults(operation=op)

    keys = groups.add_parser("keys", help="statestore API keys (keys mode)").add_subparsers(
        dest="action", required=True
    )
    p = keys.add_parser("list", parents=[common], help="list a tenant's keys (never the secrets)")
    p.add_argument("tenant", help="tenant id or name")
    p.set_defaults(operation="keys_list")
    p = keys.add_parser("create", parents=[common], help="create a key; the secret is shown once")
    p.add_argument("tenant", help="tenant id or name")
    p.add_argument("--label", help="a note to recognise the key by")
    p.set_defaults(operation="keys_create")
    p = keys.add_parser("revoke", parents=[common], help="revoke a key")
    p.add_argument("key_id")
    p.set_defaults(operation="keys_revoke")

    policy = groups.add_parser("policy", help="retention policies").add_subparsers(dest="action", required=True)
    p = policy.add_parser("show", parents=[common], help="the policy in force for 'default' or a tenant")
    p.add_argument("scope", help="'default' or a tenant id or name")
    p.set_defaults(operation="policy_show")
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
    p.set_defaults(operation="policy_set")
    p = policy.add_parser("delete", parents=[common], help="drop a tenant's override (it follows the default)")
    p.add_argument("scope")
    p.set_defaults(operation="policy_delete")

    p = groups.add_parser("audit", parents=[common], help="recent admin changes, newest first")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--by", help="only entries by this actor (an admin token's name, or cli:<login>)")
    p.add_argument("--action", help="only this action, or its prefix: policy, policy.put, key, tenant, erase")
    p.add_argument("--tenant", help="only entries about this tenant (id or name): it, its policy, keys, erasures")
    p.set_defaults(operation="audit")
    p = groups.add_parser(
        "erase", parents=[common], help="erase every thread, response and conversation of a tenant and/or a user_id"
    )
    p.add_argument("--tenant", help="tenant id or name")
    p.add_argument("--user-id", help="the metadata.user_id the threads, responses or conversations were created with")
    p.set_defaults(operation="erase")
    p = groups.add_parser(
        "erasure", parents=[common], help="an erasure's state (running, done, failed) and, once done, what it erased"
    )
    p.add_argument("id", help="the erasure's id (erasure_…), as `erase` or POST /admin/v1/erase gave it")
    p.set_defaults(operation="erasure")
    p = groups.add_parser(
        "stats", parents=[common], help="live, expired, purged and erased counts of both doors; the purger's last run"
    )
    p.add_argument("--tenant", help="tenant id or name")
    p.set_defaults(operation="stats")
    p = groups.add_parser(
        "usage", parents=[common], help="turns and bytes stored per UTC day, in all and by door, counted at commit"
    )
    p.add_argument("--days", type=int, default=30)
    p.set_defaults(operation="usage")
    p = groups.add_parser(
        "purge", parents=[common], help="delete expired threads, responses and conversations now (`statestore purge`)"
    )
    p.set_defaults(operation="purge")

    add_encryption_commands(groups, common)
