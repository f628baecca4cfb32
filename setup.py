"""Package layout only (metadata is in pyproject.toml).

The Alembic revisions stay in migrations/ at the top of the repository, where `alembic` and the developers find them,
and ship inside the package as statestore.migrations, so an installed wheel can migrate with no setting. pyproject's
declarative find cannot map one folder into another package, hence this file.

Every folder under statestore/ is a package here, those without an __init__.py too (the console's templates and
static assets): setuptools warns about data files in a folder it was not told is a package, and each folder's own
files that are not Python (templates, assets, py.typed) are its package data.
"""

from pathlib import Path

from setuptools import find_namespace_packages, setup

ROOT = Path(__file__).resolve().parent
MAPPED = {"statestore.migrations": "migrations"}
SKIPPED = ["*.__pycache__", "*.__pycache__.*"]
PACKAGES = [
    *find_namespace_packages(include=["statestore", "statestore.*"], exclude=SKIPPED),
    "statestore.migrations",
    *(f"statestore.migrations.{name}" for name in find_namespace_packages(where="migrations", exclude=SKIPPED)),
]


def _folder(package: str) -> Path:
    for mapped, folder in MAPPED.items():
        if package == mapped or package.startswith(mapped + "."):
            return ROOT / folder / Path(*package[len(mapped) + 1 :].split(".") if package != mapped else ())
    return ROOT / Path(*package.split("."))


def _data_files(package: str) -> list[str]:
    """The files of the package's own folder that are not Python (each subfolder is a package of its own)."""
    return sorted(
        path.name for path in _folder(package).iterdir() if path.is_file() and path.suffix not in (".py", ".pyc")
    )


setup(
    packages=PACKAGES,
    package_dir=MAPPED,
    package_data={package: files for package in PACKAGES if (files := _data_files(package))},
)
