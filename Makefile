# The two commands: `make run` and `make test`. Everything else is a helper.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
VAR := $(CURDIR)/var
STAMP := $(VENV)/.installed

.PHONY: run test lint typecheck unit install clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]' --config-settings editable_mode=compat
	touch $(STAMP)

install: $(STAMP)

# Demo: the router on embedded defaults, data under ./var, one reference space at demo.localhost.
run: $(STAMP)
	mkdir -p $(VAR)/data $(VAR)/run
	@test -f $(VAR)/data/demo.localhost.env || \
	  LCHAT_UNITS=builtin $(BIN)/lchat --env-file $(VAR)/router.env --data-dir $(VAR)/data \
	    --run-dir $(VAR)/run add-instance demo.localhost --no-wait
	LCHAT_UNITS=builtin LCHAT_SPACE_COMMAND="$(CURDIR)/$(BIN)/lchat space" \
	  $(BIN)/twistd -n --pidfile= lchat --env-file $(VAR)/router.env \
	    --data-dir $(VAR)/data --run-dir $(VAR)/run --http tcp:8080:interface=127.0.0.1

lint: $(STAMP)
	$(BIN)/ruff check lchat tests twisted bench
	$(BIN)/ruff format --check lchat tests twisted bench

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/trial -j2 tests

test: lint typecheck unit

clean:
	rm -rf $(VENV) $(VAR) _trial_temp* build *.egg-info
