"""The house rules the code review asked for, kept: statestore's packages import downwards only (the faces, api and
console, over the domains, threads and responses, over store and upstream), and no module grows past ~400 lines."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "statestore"
# What each package may import from the others; top-level modules (config, errors, policy, ...) are shared by all.
ALLOWED = {
    "api": {"threads", "responses", "store", "upstream"},
    "console": {"threads", "store"},
    "responses": {"threads", "store", "upstream"},
    "threads": {"store", "upstream"},
    "store": set(),
    "upstream": set(),
}
MAX_LINES = 420


def imports_between_packages() -> set[tuple[str, str, str]]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).parts
        if len(parts) < 2:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("statestore."):
                target = node.module.split(".")
                if len(target) > 2 and target[1] != parts[0] and (PACKAGE / target[1]).is_dir():
                    found.add((parts[0], target[1], str(path.relative_to(PACKAGE))))
    return found


def test_packages_import_downwards_only() -> None:
    edges = imports_between_packages()
    assert {package for package, _, _ in edges} <= set(ALLOWED), "a new package needs its place in ALLOWED"
    upward = sorted(f"{module} imports {target}" for package, target, module in edges if target not in ALLOWED[package])
    assert upward == []


def test_no_module_is_too_long() -> None:
    long = {
        str(path.relative_to(PACKAGE)): lines
        for path in PACKAGE.rglob("*.py")
        if (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}
