#!/usr/bin/env bash
# Run the suite. pytest's exit 5 ("no tests collected") is a failure here, never a green run.
set -uo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing the run" >&2
  exit 1
fi
exit "$rc"
