# statestore: two commands do all the set-up. `make run` serves the embedded default in front of the echo
# backend; `make test` prepares PostgreSQL and Redis and runs lint and the suite.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUNTIME_STAMP := $(VENV)/.runtime
PORT ?= 8080
ECHO_PORT ?= 8090

.PHONY: run test test-real real-backend lint install services system-packages upgrade-drill console-screenshots bench bench-responses bench-pg-statements bench-context bench-link campaign clean image admin

# setuptools notes, on every editable install of a package mapped from two folders (statestore/ and migrations/), that
# it is served by an import hook; it is information, not a fault of ours, and would be the install's only output.
QUIET_INSTALL := PYTHONWARNINGS='ignore:Editable installation'

# The development set-up: statestore (editable) with the test and lint tools.
$(STAMP): pyproject.toml setup.py
	@echo "installing statestore and its dev tools into $(VENV)/ (the first time: about a minute)"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -m pip install --quiet --upgrade pip
	@$(QUIET_INSTALL) $(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $(STAMP) $(RUNTIME_STAMP)

# Just enough to serve: statestore (editable) and its runtime dependencies, no dev toolchain.
$(RUNTIME_STAMP): pyproject.toml setup.py
	@echo "installing statestore into $(VENV)/ (the first time: under a minute)"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(QUIET_INSTALL) $(BIN)/python -m pip install --quiet -e .
	@touch $(RUNTIME_STAMP)

install: $(STAMP)

# The official TypeScript SDK, for tests/integration/test_typescript_sdk.py (npm ci: exactly the locked versions).
NODE_DEPS := tests/node/node_modules/.package-lock.json
$(NODE_DEPS): tests/node/package.json tests/node/package-lock.json
	npm ci --prefix tests/node --no-audit --no-fund --loglevel=error
	touch $(NODE_DEPS)

# The embedded default: SQLite file and in-process cache, echo backend on $(ECHO_PORT). With
# STATESTORE_DATABASE_URL / STATESTORE_REDIS_URL / STATESTORE_UPSTREAM_URL set, the same target uses those.
run: $(RUNTIME_STAMP)
	@scripts/run-local.sh $(PORT) $(ECHO_PORT)

# The admin CLI without activating the venv: make admin ARGS='tenants create acme'
# (the same as .venv/bin/statestore admin tenants create acme).
admin: $(RUNTIME_STAMP)
	@$(BIN)/statestore admin $(ARGS)

# The container image (podman; base image from debootstrap, cached): make image [STATESTORE_IMAGE=name:tag]
image:
	@scripts/image.sh build

services:
	@scripts/ensure-services.sh

lint: $(STAMP)
	$(BIN)/ruff check statestore tests bench migrations
	$(BIN)/ruff format --check statestore tests bench migrations
	$(BIN)/mypy
	@# deploy/: each tool runs offline from its PyPI package (schemas and the hadolint binary ship in the wheels).
	$(BIN)/hadolint --config deploy/hadolint.yaml deploy/Dockerfile
	$(BIN)/yamllint --strict -c deploy/yamllint.yaml .
	$(BIN)/kubernetes-validate --strict --quiet $(filter-out %/kustomization.yaml,$(wildcard deploy/kubernetes/*.yaml))
	$(BIN)/check-jsonschema --builtin-schema vendor.compose-spec deploy/compose.yaml
	$(BIN)/ruff check deploy
	$(BIN)/ruff format --check deploy
	$(BIN)/python deploy/constraints.py check
	@# docs/: the reference as a site, in strict mode (a broken link, a stale anchor or a page outside the nav fails),
	@# built to a temporary folder and thrown away. Not --quiet: it would hide the warnings strict mode counts.
	@site="$$(mktemp -d)"; NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir "$$site"; \
		status=$$?; rm -rf "$$site"; exit $$status

# haproxy, podman, runc, debootstrap, chromium and chromedriver: installed when root with apt-get, else named with the
# one command that installs them, before any other step.
system-packages:
	@scripts/ensure-system-packages.sh

# llama.cpp's server and the tiny model tests/realbackend runs it with, built once into ~/.cache/statestore/ (about
# nine minutes on two cores); later runs find them there.
real-backend: system-packages $(STAMP)
	@scripts/real-backend.sh $(BIN)/python >/dev/null

# Prerequisites run in this order: the system packages first, so a machine without them stops at once. The suite runs
# on TEST_WORKERS pytest-xdist workers, each module whole on one; TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
test: system-packages $(STAMP) lint services $(NODE_DEPS) real-backend
	@scripts/run-tests.sh $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)

# Only the real-backend suite (tests/realbackend): statestore in front of a real llama-server.
test-real: system-packages $(STAMP) services real-backend
	@scripts/run-tests.sh -m real_backend tests/realbackend

# The admin console's pictures in docs/console.md (docs/console/*.png), taken by its browser tests.
console-screenshots: system-packages $(STAMP) services
	STATESTORE_CONSOLE_SCREENSHOTS=docs/console $(BIN)/python -m pytest -q tests/integration/test_console.py

# The default fault campaign (tests/campaign): 32 clients, >= 20,000 operations and >= 50 faults against three
# replicas, PostgreSQL and Redis of its own; `make test` runs the short one. CAMPAIGN_SEED=<n> replays a schedule.
campaign: $(STAMP)
	STATESTORE_CAMPAIGN=full $(if $(CAMPAIGN_SEED),STATESTORE_CAMPAIGN_SEED=$(CAMPAIGN_SEED)) \
		$(BIN)/python -m pytest -q -s -p no:cacheprovider tests/campaign/test_campaign.py

# The rolling upgrade from the previous release and the rollback, under load (tests/upgrade; docs/deployment.md says
# what it checks); `make test` runs its short form.
upgrade-drill: $(STAMP) services
	STATESTORE_DRILL=full $(BIN)/python -m pytest -q -s -p no:cacheprovider tests/upgrade

bench: $(STAMP) services
	$(BIN)/python -m bench $(BENCH_ARGS)

# The Responses continue beside the threaded continue at 2k and 200k tokens (bench/responses_arm.py), then background
# responses beside foreground ones: turns, resumed streams, cancels (bench/background_arm.py).
bench-responses: $(STAMP) services
	$(BIN)/python -m bench.responses_arm $(BENCH_ARGS)
	$(BIN)/python -m bench.background_arm $(BACKGROUND_BENCH_ARGS)

# PostgreSQL's share of a turn, statement by statement, on a throwaway cluster with pg_stat_statements
# (bench/pg_statements.py).
bench-pg-statements: $(STAMP) services
	$(BIN)/python -m bench.pg_statements $(PG_STATEMENTS_ARGS)

# Long conversations (docs/protocol.md §9): a continue on 10 MB archived vs a 200 KB thread; a truncate step vs a cold
# rebuild. CONTEXT_BENCH_ARGS: --turns N --archive-mb M --context-kb K.
bench-context: $(STAMP) services
	$(BIN)/python -m bench.context_arm $(CONTEXT_BENCH_ARGS)

# A client on a shaped link (network namespace, veth, tbf at 10/50/200 Mbit/s): threaded continue vs the whole history
# sent to the backend, and llama-server's prompt cache; writes bench/plots/link-*.png (bench/link.py). Needs root.
bench-link: $(STAMP) services real-backend
	$(BIN)/python -m bench.link $(LINK_BENCH_ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis statestore.db statestore.db-*
