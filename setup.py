"""Package layout only (metadata is in pyproject.toml).

The Alembic revisions stay in migrations/ at the top of the repository, where `alembic` and the developers find them,
and ship inside the package as statestore.migrations, so an installed wheel can migrate with no setting. pyproject's
declarative find cannot map one folder into another package, hence this file: every statestore subpackage is still
discovered automatically.
"""

from setuptools import find_packages, setup

setup(
    packages=[
        *find_packages(include=["statestore", "statestore.*"]),
        "statestore.migrations",
        "statestore.migrations.versions",
    ],
    package_dir={"statestore.migrations": "migrations"},
    package_data={"statestore": ["py.typed"], "statestore.migrations": ["script.py.mako"]},
)
