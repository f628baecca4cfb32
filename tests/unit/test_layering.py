"""The packages of statestore/ import downwards only (docs/architecture.md, "Layout"): the faces in api/ and the
Responses door over the threaded turn, both over the store and the backend client, the console over the store, with no
cycle. Read from the source, lazy imports inside functions included, so a shortcut taken anywhere fails here. ALLOWED
below is the one table of the layering: no other test keeps one, and each of its edges is one the code takes."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "statestore"

# Which packages each package may import; modules at the top of statestore/ (config, errors, policy, ...) are shared.
ALLOWED: dict[str, set[str]] = {
    "api": {"core", "responses", "threads", "store", "upstream"},
    "console": {"store"},
    "core": {"store", "upstream"},
    "encryption": {"store"},
    "responses": {"core", "threads", "store", "upstream"},
    "threads": {"core", "store", "upstream"},
    "store": set(),
    "upstream": set(),
}


def package_imports() -> dict[str, dict[str, set[str]]]:
    """package -> imported package -> the modules that import it."""
    found: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for path in PACKAGE_ROOT.rglob("*.py"):
        parts = path.relative_to(PACKAGE_ROOT).parts
        if len(parts) < 2:
            continue  # a top-level module
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                target = name.split(".")
                inside = target[0] == "statestore" and len(target) > 1 and (PACKAGE_ROOT / target[1]).is_dir()
                if inside and target[1] != parts[0]:
                    found[parts[0]][target[1]].add(str(path.relative_to(PACKAGE_ROOT.parent)))
    return found


def test_every_package_is_known() -> None:
    packages = {p.name for p in PACKAGE_ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(ALLOWED), "a package was added or removed: say where it sits in ALLOWED"


def test_packages_import_downwards_only() -> None:
    wrong = {
        f"{package} -> {target}: {sorted(modules)}"
        for package, targets in package_imports().items()
        for target, modules in targets.items()
        if target not in ALLOWED[package]
    }
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(wrong))


def test_every_allowed_import_is_one_the_code_makes() -> None:
    """The table is the layering as it is, not a wish: an edge no module takes is a claim nothing checks."""
    made = package_imports()
    unused = {
        f"{package} -> {target}"
        for package, targets in ALLOWED.items()
        for target in targets
        if target not in made.get(package, {})
    }
    assert not unused, "allowed but never imported (drop it from ALLOWED and docs/architecture.md):\n" + "\n".join(
        sorted(unused)
    )


def test_the_allowed_graph_has_no_cycle() -> None:
    seen: set[str] = set()

    def visit(package: str, path: tuple[str, ...]) -> None:
        assert package not in path, f"cycle: {' -> '.join((*path, package))}"
        if package in seen:
            return
        for target in ALLOWED[package]:
            visit(target, (*path, package))
        seen.add(package)

    for package in ALLOWED:
        visit(package, ())
