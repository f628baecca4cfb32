"""statestore uses its libraries as published: no module imports a library's private name or internal module, so a
new release of asyncpg, redis-py or prometheus_client cannot break it by renaming what it never promised (asyncpg's
array encoder was once patched through `asyncpg.protocol`'s private names for 0.972x instructions; it is not)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "statestore"
# Modules of a library that are its machinery, not its API, though their names carry no underscore.
INTERNAL = {"asyncpg.protocol", "asyncpg.pgproto"}


def _private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))


def test_no_module_imports_a_librarys_private_name_or_internal_module() -> None:
    found: list[str] = []
    for path in PACKAGE_ROOT.rglob("*.py"):
        where = str(path.relative_to(PACKAGE_ROOT.parent))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.split(".")[0] == "statestore":
                    continue
                modules = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            for module in modules:
                if module.split(".")[0] == "statestore":
                    continue
                if _private(module) or any(module == m or module.startswith(m + ".") for m in INTERNAL):
                    found.append(f"{where}: {module}")
    assert not found, found
