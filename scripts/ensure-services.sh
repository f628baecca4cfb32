#!/usr/bin/env bash
# Start PostgreSQL and Redis with the machine's own commands when they are not answering, then wait for them.
# Used by `make test` (and so by CI): a service that cannot be brought up fails the run instead of skipping tests.
# (The system packages are scripts/ensure-system-packages.sh's, which `make test` runs first.)
set -euo pipefail

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
