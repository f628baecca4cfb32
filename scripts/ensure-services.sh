#!/usr/bin/env bash
# Start PostgreSQL and Redis with the machine's own commands when they are not answering, then wait for them.
# Used by `make test` (and so by CI): a service that cannot be brought up fails the run instead of skipping tests.
set -euo pipefail

# System packages some tests need: haproxy (tests/scaleout starts its own, in front of three replicas); podman,
# runc and debootstrap (tests/packaging/test_image.py builds and runs the container image). Under CI (CI=true) they are
# installed with apt-get when missing; on anyone else's machine nothing is installed: the run says what is missing
# and the command that installs it.
missing=()
have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || [ -x "/sbin/$1" ]; }
for tool in haproxy podman runc debootstrap; do
  have "$tool" || missing+=("$tool")
done
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "${CI:-}" = "true" ] && [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "CI: installing ${missing[*]} with apt-get" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2 || true
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2 || echo "apt-get could not install ${missing[*]}" >&2
  else
    echo "not installed: ${missing[*]} (Debian/Ubuntu: sudo apt-get install ${missing[*]})." >&2
    echo "  haproxy: tests/scaleout fail without it; podman, runc, debootstrap: the container image test is not run." >&2
  fi
fi

pg_up() { pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; }
redis_up() { redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null | grep -q PONG; }

if ! pg_up; then
  echo "PostgreSQL is not answering on 127.0.0.1:5432; starting it" >&2
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
fi
if ! redis_up; then
  echo "Redis is not answering on 127.0.0.1:6379; starting it" >&2
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no || true
fi

for _ in $(seq 1 60); do
  if pg_up && redis_up; then exit 0; fi
  sleep 0.5
done
pg_up || echo "PostgreSQL did not come up on 127.0.0.1:5432" >&2
redis_up || echo "Redis did not come up on 127.0.0.1:6379" >&2
exit 1
