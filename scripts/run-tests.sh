#!/usr/bin/env bash
# Run the suite. pytest's exit 5 ("no tests collected") is a failure here, never a green run.
set -uo pipefail
cd "$(dirname "$0")/.."
# The container image test needs podman (and debootstrap for its base image): without them it is left out, loudly.
# CI installs both (scripts/ensure-services.sh), so there it always runs.
extra=()
PATH="$PATH:/usr/sbin:/sbin"
if ! command -v podman >/dev/null 2>&1 || ! command -v debootstrap >/dev/null 2>&1; then
  if [ "${CI:-}" = "true" ]; then
    echo "CI: podman and debootstrap are required for tests/packaging/test_image.py" >&2
    exit 1
  fi
  echo "NOT RUN: tests/packaging/test_image.py (the container image): podman or debootstrap is missing;" \
    "install them with: sudo apt-get install podman runc debootstrap" >&2
  extra+=(--ignore=tests/packaging/test_image.py)
fi
.venv/bin/python -m pytest "${extra[@]}" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing the run" >&2
  exit 1
fi
exit "$rc"
