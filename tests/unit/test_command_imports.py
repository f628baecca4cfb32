"""`statestore --help`, `statestore admin --help` and the admin commands import only what they use: operators run
them by hand and in scripts, and the server's stack behind statestore/resources.py (the doors, the backend clients,
the metrics) cost every admin command a second. The parser (statestore/admin_parser.py) imports neither the settings
nor the database; an admin command builds the admin's wiring alone (statestore/admin_setup.py). Counted in a process
of its own, which is what an operator's command is: the test process has imported everything already."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.server import REPO

# What the server needs and no admin command does.
SERVER_STACK = (
    "statestore.resources",
    "statestore.app",
    "statestore.api",
    "statestore.core",
    "statestore.responses",
    "statestore.upstream",
    "statestore.threads.service",
    "statestore.metrics",
    "fastapi",
    "starlette",
    "uvicorn",
    "httpx",
    "prometheus_client",
    "alembic",
)
# What a command needs before it runs, and printing help never does: the settings, the database, the admin.
COMMAND_STACK = (
    "pydantic",
    "pydantic_settings",
    "sqlalchemy",
    "statestore.config",
    "statestore.store",
    "statestore.admin",
)

# Runs `statestore` commands one after the other in one process, as `statestore` would (an exit's message on
# stderr), then writes what they imported, and each one's exit code, to the file named first.
RUN_COMMANDS = """
import json, sys
from statestore.cli import main
codes = []
for argv in json.loads(sys.argv[2]):
    try:
        main(argv)
        codes.append(0)
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        codes.append(exc.code if isinstance(exc.code, int) else 1)
with open(sys.argv[1], "w") as f:
    json.dump({"modules": sorted(sys.modules), "codes": codes}, f)
"""


def run_commands(tmp_path: Path, env: dict[str, str], commands: list[list[str]]) -> tuple[set[str], list[int], str]:
    out = tmp_path / "imported.json"
    done = subprocess.run(
        [sys.executable, "-c", RUN_COMMANDS, str(out), json.dumps(commands)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    found = json.loads(out.read_text())
    return set(found["modules"]), found["codes"], done.stdout + done.stderr


def among(modules: set[str], packages: tuple[str, ...]) -> list[str]:
    """The packages of `packages` imported (their modules counted under each package's name)."""
    return sorted({p for p in packages for m in modules if m == p or m.startswith(p + ".")})


def command_env(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STATESTORE_")}
    env.update({f"STATESTORE_{name.upper()}": value for name, value in settings.items()})
    return env


def test_help_imports_neither_the_settings_nor_the_database(tmp_path: Path) -> None:
    modules, codes, shown = run_commands(
        tmp_path, command_env(), [["--help"], ["admin", "--help"], ["admin", "policy", "set", "--help"]]
    )
    assert codes == [0, 0, 0], shown
    assert "--threads-enabled" in shown  # the parser was built, the encryption commands' too
    assert "encryption" in shown
    assert among(modules, COMMAND_STACK + SERVER_STACK) == []


def test_admin_commands_import_the_admin_alone(tmp_path: Path, migrated_sqlite_url: str) -> None:
    commands = [
        ["admin", "tenants", "create", "acme"],
        ["admin", "tenants", "list", "--json"],
        ["admin", "keys", "create", "acme"],
        ["admin", "policy", "set", "acme", "--max-messages", "500"],
        ["admin", "stats"],
        ["admin", "erase", "--tenant", "acme"],
        ["admin", "erasure", "erasure_nope"],
        ["purge"],
    ]
    modules, codes, shown = run_commands(
        tmp_path, command_env(database_url=migrated_sqlite_url, auth_mode="keys"), commands
    )
    # Each command ran to its end (a refusal before the database would import nothing either).
    assert codes == [0, 0, 0, 0, 0, 0, 1, 0], shown
    assert "created tenant acme" in shown
    assert '"name": "acme"' in shown
    assert "max_messages: 500" in shown
    assert "no erasure 'erasure_nope'" in shown
    assert "purged 0 expired threads" in shown
    assert "statestore.admin_setup" in modules
    assert among(modules, SERVER_STACK) == []
