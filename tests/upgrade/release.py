"""An earlier release of statestore, as an operator would have it installed: the wheel built from its commit, unpacked
into a folder of its own, run by this venv's interpreter with that folder first on its path (the dependencies are
the same; a wheel of pure Python is installed by unpacking it). Built once per commit and kept outside the checkout
(STATESTORE_DRILL_CACHE, default ~/.cache/statestore-drill), as slow things to build are."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The last release before the one conversation-log core (issue 21): what a rolling upgrade replaces and rolls back to.
BASELINE = "26661a8aeed61410de6826a74caebe5065877e06"
PACKAGED = ["pyproject.toml", "setup.py", "README.md", "LICENSE", "statestore", "migrations"]


@dataclass(frozen=True)
class Release:
    commit: str
    site: Path  # the unpacked wheel

    def command(self) -> list[str]:
        """`statestore` of this release (its argv up to the subcommand)."""
        return [sys.executable, "-c", "import sys; from statestore.cli import main; sys.exit(main())"]

    def env(self) -> dict[str, str]:
        """What puts this release, not the checkout, on the interpreter's path."""
        return {"PYTHONPATH": str(self.site), "PYTHONSAFEPATH": "1"}


def _cache_root() -> Path:
    return Path(os.environ.get("STATESTORE_DRILL_CACHE", Path.home() / ".cache" / "statestore-drill"))


def _run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[bytes]:
    result = subprocess.run(argv, capture_output=True, check=False, **kwargs)  # type: ignore[call-overload]
    if result.returncode != 0:
        raise RuntimeError(f"{argv[:4]} exited {result.returncode}: {result.stderr.decode(errors='replace')[-2000:]}")
    return result  # type: ignore[no-any-return]


def release_at(commit: str = BASELINE) -> Release:
    """The release built from `commit` of this repository's history (a clone of main has it)."""
    site = _cache_root() / commit / "site"
    if (site / "statestore" / "cli.py").is_file():
        return Release(commit, site)
    with tempfile.TemporaryDirectory(prefix="statestore-release-") as scratch:
        work = Path(scratch)
        archive = work / "source.tar"
        _run(["git", "-C", str(REPO), "archive", "--format=tar", "-o", str(archive), commit, *PACKAGED])
        source = work / "source"
        source.mkdir()
        with tarfile.open(archive) as tar:
            tar.extractall(source, filter="data")
        dist = work / "dist"
        _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(dist), str(source)])
        (wheel,) = dist.glob("statestore-*.whl")
        unpacked = work / "site"
        with zipfile.ZipFile(wheel) as archive_file:
            archive_file.extractall(unpacked)
        site.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(site, ignore_errors=True)
        shutil.move(unpacked, site)  # whole or not at all: a build cut short is built again next time
    return Release(commit, site)
