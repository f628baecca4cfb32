"""Fixtures for the packaging tests: statestore as a user installs it, away from this checkout.

- ``fake_backend`` (session): the scriptable fake model backend (tests/support/fake_backend.py).
- ``wheel`` (session): the wheel `pip wheel` builds from this checkout.
- ``installed`` (session, twice): a fresh virtual environment outside the checkout with that wheel installed from the
  package index, its dependencies at the image's pins (deploy/constraints.txt) and then at pyproject.toml's lower
  bounds; its ``statestore`` command.
- ``outside_env`` (function): an environment with no STATESTORE_* setting and no PYTHONPATH, so nothing leads the
  installed command back to the checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.support.fake_backend import FakeBackend

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def fake_backend() -> Iterator[FakeBackend]:
    with FakeBackend() as backend:
        yield backend


def run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, check=False, **kwargs)  # type: ignore[call-overload]
    assert result.returncode == 0, f"{argv} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result  # type: ignore[no-any-return]


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # From a copy of what the package is built from, as the image's build context is: a build in the checkout would
    # reuse its build/ folder, stale files included.
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, source / name)
    for folder in ("statestore", "migrations"):
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(dist), str(source)])
    (built,) = dist.glob("statestore-*.whl")
    return built


def lower_bounds() -> str:
    """Constraints pinning every runtime dependency at the lower bound pyproject.toml declares (`>=X` → `==X`)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = []
    for text in project["dependencies"]:
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        (bound,) = (spec.version for spec in requirement.specifier if spec.operator == ">=")
        pins.append(f"{requirement.name}=={bound}")
    return "\n".join(pins) + "\n"


@pytest.fixture(scope="session", params=["image-pins", "lower-bounds"])
def installed(request: pytest.FixtureRequest, wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel in a fresh venv, with its dependencies at the image's pins (deploy/constraints.txt), or at the lower
    bounds pyproject.toml declares: those bounds are what the code is tested with, not a guess."""
    environment = tmp_path_factory.mktemp("venv") / "venv"
    # No pip of its own (ensurepip costs seconds of CPU): this venv's pip installs into it (`pip --python`), and
    # without byte-compiling every dependency, which Python does itself for the modules a test imports.
    venv.create(environment, with_pip=False)
    constraints = REPO / "deploy" / "constraints.txt"
    if request.param == "lower-bounds":
        constraints = environment.parent / "lower-bounds.txt"
        constraints.write_text(lower_bounds())
    python = environment / "bin" / "python"
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-compile",
            "--only-binary=:all:",
            "--constraint",
            str(constraints),
            str(wheel),
        ],
        cwd=environment,
    )
    return environment / "bin" / "statestore"


@pytest.fixture
def outside_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("STATESTORE_") and k != "PYTHONPATH"}
