#!/usr/bin/env bash
# The system packages the suite uses, checked before anything else `make test` does:
#   haproxy                      tests/scaleout starts its own in front of three replicas;
#   podman, runc, debootstrap    tests/packaging/test_image.py builds the container image and runs it;
#   chromium, chromium-driver    tests/integration/test_console.py drives the admin console in a headless browser;
#   cmake, g++                   scripts/real-backend.sh builds llama.cpp's server for tests/realbackend.
# As root with apt-get it installs what is missing and says so in one line; otherwise it stops at once, naming the
# one command that installs them, so no run gets two minutes in before it finds out.
set -euo pipefail

declare -A needed=(
  [haproxy]=haproxy
  [podman]=podman
  [runc]=runc
  [debootstrap]=debootstrap
  [chromium]=chromium
  [chromedriver]=chromium-driver
  [cmake]=cmake
  [g++]=g++
)
have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || [ -x "/sbin/$1" ] || [ -x "/usr/bin/$1" ]; }

missing=()
for tool in haproxy podman runc debootstrap chromium chromedriver cmake g++; do
  have "$tool" || missing+=("${needed[$tool]}")
done
[ "${#missing[@]}" -eq 0 ] && exit 0

if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "make test: installing ${missing[*]} with apt-get (scale-out, container image, console browser and real-backend tests)" >&2
  log="$(mktemp)"
  export DEBIAN_FRONTEND=noninteractive
  # Another apt (unattended upgrades, a second checkout's make) may hold the lock for a while: wait for it.
  wait_lock=(-o DPkg::Lock::Timeout=600)
  if apt-get "${wait_lock[@]}" update -qq >"$log" 2>&1 \
    && apt-get "${wait_lock[@]}" install -y -qq --no-install-recommends "${missing[@]}" >>"$log" 2>&1; then
    rm -f "$log"
    exit 0
  fi
  cat "$log" >&2
  echo "make test: apt-get could not install ${missing[*]} (its output is above)" >&2
  exit 1
fi

echo "make test needs these system packages first: ${missing[*]}" >&2
echo "  install them with: sudo apt-get install --no-install-recommends ${missing[*]}" >&2
exit 1
