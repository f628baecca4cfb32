"""podman as this project runs it: runc, cgroupfs, the project's containers.conf, the host's network."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONTAINERS_CONF = REPO / "deploy" / "podman" / "containers.conf"
PODMAN = ["podman", "--runtime", "runc", "--cgroup-manager=cgroupfs"]


def podman_env() -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": os.environ.get("CONTAINERS_CONF", str(CONTAINERS_CONF))}


def podman(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [*PODMAN, *args], env=podman_env(), capture_output=True, text=True, check=False, timeout=timeout
    )
    if check and result.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


def build_image(tag: str) -> None:
    """scripts/image.sh: the cached debootstrap base, then deploy/Dockerfile (layers cached by podman)."""
    result = subprocess.run(
        [str(REPO / "scripts" / "image.sh"), "build"],
        env={**podman_env(), "STATESTORE_IMAGE": tag},
        capture_output=True,
        text=True,
        check=False,
        timeout=1200,
    )
    if result.returncode != 0:
        raise AssertionError(f"scripts/image.sh build failed ({result.returncode}):\n{result.stderr[-6000:]}")
