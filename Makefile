# The two commands: `make run` and `make test`. Everything else is a helper.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
VAR := $(CURDIR)/var
STAMP := $(VENV)/.installed

.PHONY: run test test-box lint typecheck unit install tools clean

$(STAMP): setup.cfg pyproject.toml setup.py lchat/proxy/_oneread_c.pyx lchat/proxy/hot.py lchat/proxy/hot.pxd
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# Demo: the router on embedded defaults, data under ./var, one reference space at demo.localhost.
# The demo space hibernates on a file: bucket in var/bucket with a 30 s idle window: watch it
# sleep and wake in the log. var/router.env is rewritten each time (it is generated); the demo's
# data in var/data and var/bucket is kept.
run: $(STAMP)
	mkdir -p $(VAR)/data $(VAR)/run $(VAR)/bucket
	printf '%s\n' \
	  "LCHAT_DATA_DIR=$(VAR)/data" \
	  "LCHAT_RUN_DIR=$(VAR)/run" \
	  "LCHAT_HTTP_ADDR=127.0.0.1:8080" \
	  "LCHAT_HTTPS_ADDR=127.0.0.1:8443" \
	  "LCHAT_HTTP_REDIRECT=off" \
	  "LCHAT_ACME_DIRECTORY=off" \
	  "LCHAT_UNITS=builtin" \
	  "LCHAT_SPACE_COMMAND=$(CURDIR)/$(BIN)/lchat space" \
	  "LCHAT_SIDECAR_COMMAND=$(CURDIR)/$(BIN)/python -m lchat.space.sidecar" \
	  "LCHAT_HIBERNATE_BUCKET=file:$(VAR)/bucket" \
	  "LCHAT_HIBERNATE_IDLE=30s" \
	  "LCHAT_HIBERNATE_SWEEP=2s" > $(VAR)/router.env
	@test -f $(VAR)/data/demo.localhost.env || \
	  $(BIN)/lchat add-instance demo.localhost --env-file $(VAR)/router.env --hibernate
	@$(BIN)/lchat instances --env-file $(VAR)/router.env --json | grep -q '"hibernate": true' || \
	  $(BIN)/lchat hibernate demo.localhost --on --env-file $(VAR)/router.env >/dev/null 2>&1 || true
	@$(BIN)/lchat dev-cert --env-file $(VAR)/router.env demo.localhost >/dev/null
	printf '%s\n' \
	  "LCHAT_DATA_DIR=$(VAR)/data" \
	  "LCHAT_RUN_DIR=$(VAR)/run" \
	  "LCHAT_HOME_ORIGINS=https://home.localhost:8443" > $(VAR)/home.env
	@$(BIN)/lchat dev-cert --env-file $(VAR)/router.env home.localhost >/dev/null
	$(BIN)/twistd --nodaemon --pidfile= lchat-home --env-file $(VAR)/home.env & home=$$!; \
	  trap 'kill $$home 2>/dev/null' EXIT INT TERM; \
	  for i in $$(seq 100); do test -S $(VAR)/run/home.sock && break; sleep 0.1; done; \
	  $(BIN)/lchat instances --env-file $(VAR)/router.env --json | grep -q '"home.localhost"' || \
	    $(BIN)/lchat add-service home.localhost --socket $(VAR)/run/home.sock \
	      --env-file $(VAR)/router.env >/dev/null 2>$(VAR)/add-service.err || \
	    { cat $(VAR)/add-service.err >&2; exit 1; }; \
	  $(BIN)/twistd --nodaemon --pidfile= lchat --env-file $(VAR)/router.env

lint: $(STAMP)
	$(BIN)/ruff check lchat tests twisted $(wildcard bench)
	$(BIN)/ruff format --check lchat tests twisted $(wildcard bench)

typecheck: $(STAMP)
	$(BIN)/mypy

# The ACME tests run a real CA: Debian's pebble (pebble + pebble-challtestsrv), installed here
# when missing (as root, which CI is; otherwise it says what to run).
tools:
	@if ! command -v pebble >/dev/null || ! command -v pebble-challtestsrv >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian's pebble (the ACME test CA)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pebble >/dev/null; \
	  else \
	    echo "make test needs Debian's pebble (the ACME test CA): sudo apt-get install pebble" >&2; \
	    exit 1; \
	  fi; \
	fi

# Three modules at a time on two cores: a router test mostly waits (the suite's CPU time is about
# half the sum of its modules' wall times; tests.parallel prints both), and a load-sensitive
# module keeps at most one beside it (tests.parallel's AT_MOST).
unit: $(STAMP) tools
	$(BIN)/python -m tests.parallel -j3

test: lint typecheck unit

# The box tests (tests/box/, not part of `make test`): README's "A real box" run literally in a
# Debian 12 container that systemd-nspawn boots with systemd as PID 1, then lchat's units under
# that real systemd (tests/systembox.py). Needs root, systemd-nspawn and debootstrap (Debian:
# systemd-container debootstrap); without them it says why in one line and passes. The root file
# system is built once per machine (~1 min) into /var/cache/lchat-box; a run takes ~1.5 min.
test-box: $(STAMP)
	@if why=$$($(BIN)/python -m tests.systembox --check); then \
	  $(BIN)/python -m twisted.trial --temp-directory=$${TMPDIR:-/tmp}/lchat-box-trial tests.box; \
	else echo "$$why"; fi

clean:
	rm -rf $(VENV) $(VAR) _trial_temp* build *.egg-info
