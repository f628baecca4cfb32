#!/usr/bin/env bash
# `make run`: migrate and serve statestore. Without STATESTORE_UPSTREAM_URL it starts the built-in echo backend and
# points statestore at it; without STATESTORE_DATABASE_URL it uses the SQLite file ./statestore.db.
set -euo pipefail
cd "$(dirname "$0")/.."
port="${1:-8080}"
echo_port="${2:-8090}"
bin=.venv/bin

# The owner secret keys the hash that ties threads to credentials. Keep a local one for trying things out.
if [ -z "${STATESTORE_OWNER_SECRET:-}" ]; then
  mkdir -p .statestore
  [ -s .statestore/owner-secret ] || "$bin/python" -c 'import secrets; print(secrets.token_urlsafe(32))' > .statestore/owner-secret
  chmod 600 .statestore/owner-secret
  STATESTORE_OWNER_SECRET="$(cat .statestore/owner-secret)"
  export STATESTORE_OWNER_SECRET
fi
export STATESTORE_LOG_JSON="${STATESTORE_LOG_JSON:-false}"

# A port something else already listens on would make the server fail after it says it is ready, or point
# statestore at a stranger instead of the echo backend: refuse before starting anything.
in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
for pair in "$port:PORT" "$echo_port:ECHO_PORT"; do
  p="${pair%%:*}" var="${pair#*:}"
  [ "$var" = ECHO_PORT ] && [ -n "${STATESTORE_UPSTREAM_URL:-}" ] && continue
  if in_use "$p"; then
    echo "make run: port $p is already in use on 127.0.0.1; choose another with make run $var=<port>" >&2
    exit 1
  fi
done

echo_pid=""
cleanup() { [ -n "$echo_pid" ] && kill "$echo_pid" 2>/dev/null || true; }
trap cleanup EXIT INT TERM

if [ -z "${STATESTORE_UPSTREAM_URL:-}" ]; then
  export STATESTORE_CHAT_UPSTREAM_URL="${STATESTORE_CHAT_UPSTREAM_URL:-http://127.0.0.1:$echo_port}"
  "$bin/statestore" echo-backend --port "$echo_port" &
  echo_pid=$!
  # Serve only once the echo backend answers, so a first request never meets a backend still starting.
  for _ in $(seq 100); do
    in_use "$echo_port" && break
    kill -0 "$echo_pid" 2>/dev/null || { echo "make run: the echo backend did not start (see above)" >&2; exit 1; }
    sleep 0.1
  done
  in_use "$echo_port" || { echo "make run: the echo backend is not answering on port $echo_port" >&2; exit 1; }
  export STATESTORE_UPSTREAM_URL="http://127.0.0.1:$echo_port"
  echo "echo backend on $STATESTORE_UPSTREAM_URL (replies echo your last message)"
fi

"$bin/statestore" migrate
echo "statestore on http://127.0.0.1:$port — try the README's curl and SDK examples"
echo "the admin CLI from this checkout: .venv/bin/statestore admin --help (or: make admin ARGS='stats')"
if [ -n "${STATESTORE_ADMIN_TOKENS:-}" ]; then
  echo "admin console on http://127.0.0.1:$port/admin/console (sign in with an admin token)"
fi
"$bin/statestore" serve --port "$port"
