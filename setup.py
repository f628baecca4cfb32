"""Package layout only (metadata is in pyproject.toml).

The Alembic revisions stay in migrations/ at the top of the repository, where `alembic` and the developers find them,
and ship inside the package as statestore.migrations, so an installed wheel can migrate with no setting. pyproject's
declarative find cannot map one folder into another package, hence this file. Every statestore subpackage (a folder
with an __init__.py) is found automatically, and so is every non-Python file inside them (templates, static assets,
py.typed), folders without an __init__.py included.
"""

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
MAPPED = {"statestore.migrations": "migrations"}
PACKAGES = [*find_packages(include=["statestore", "statestore.*"]), *MAPPED, "statestore.migrations.versions"]


def _folder(package: str) -> Path:
    for mapped, folder in MAPPED.items():
        if package == mapped or package.startswith(mapped + "."):
            return ROOT / folder / Path(*package[len(mapped) + 1 :].split(".") if package != mapped else ())
    return ROOT / Path(*package.split("."))


def _data_files(package: str) -> list[str]:
    """The package's files that are not Python, relative to it, down to (not into) its subpackages."""
    top = _folder(package)
    found = []
    for path in sorted(top.rglob("*")):
        if not path.is_file() or path.suffix in (".py", ".pyc") or "__pycache__" in path.parts:
            continue
        between = [folder for folder in [path.parent, *path.parent.parents] if top in folder.parents]
        if any((folder / "__init__.py").is_file() for folder in between):
            continue  # in a subpackage, which lists it itself
        found.append(str(path.relative_to(top)))
    return found


setup(
    packages=PACKAGES,
    package_dir=MAPPED,
    package_data={package: files for package in PACKAGES if (files := _data_files(package))},
)
