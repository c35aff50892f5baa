# heapscope: `make demo` shows it working, `make test` checks it. Both run `make setup` first,
# which is idempotent (see scripts/setup.sh) and takes about a second once everything is in place.

VENV      := .venv
PY        := $(VENV)/bin/python
HEAPSCOPE := $(VENV)/bin/heapscope
CC        := gcc
OUT       := out

.PHONY: setup demo test unit lint bench bench-quick bench-latency clean

setup:
	bash scripts/setup.sh

# The demo workload: frame pointers and -O1 so the trees show each level of calls.
demo/build/phases: demo/phases.c | setup
	mkdir -p demo/build
	$(CC) -g -O1 -fno-omit-frame-pointer -o $@ $<

# The daemon, attached to the demo workload from its first instruction: it prints the curl lines to try while
# the workload runs (DEMO_SECONDS), then ms_print's report of the whole run.
DEMO_SECONDS ?= 60
DEMO_HTTP    ?= 127.0.0.1:7411

demo: setup demo/build/phases
	mkdir -p $(OUT)
	@echo "make demo: heapscope serves the profile of demo/build/phases on http://$(DEMO_HTTP) for $(DEMO_SECONDS) s;"
	@echo "make demo: run the curl lines below in another terminal (Ctrl-C ends early, writing the profile)."
	$(HEAPSCOPE) run --http $(DEMO_HTTP) --output-dir $(OUT) --time-unit=ms --massif-out-file=massif.out.phases \
		-- demo/build/phases $(DEMO_SECONDS)
	ms_print $(OUT)/massif.out.phases

lint: setup
	$(VENV)/bin/ruff check
	$(VENV)/bin/mypy agent api
	$(VENV)/bin/lint-imports

# All of them run even if one fails, so a CI log shows every problem at once; any failure fails the target,
# including pytest's exit code 5 (no tests collected). lint-imports checks the layers (pyproject.toml).
test: setup
	@status=0; \
	echo "+ ruff check"; $(VENV)/bin/ruff check || status=1; \
	echo "+ mypy agent api"; $(VENV)/bin/mypy agent api || status=1; \
	echo "+ lint-imports"; $(VENV)/bin/lint-imports || status=1; \
	echo "+ pytest -v tests"; $(VENV)/bin/pytest -v --durations=30 tests || status=1; \
	exit $$status

# The checks that need no root and no external tools: the virtualenv only (no Debian packages), then the linters
# and tests/unit but for the tests marked `tools` (they run gcc, Valgrind, gdb, binutils... or need root: tests/conftest.py);
# `make test` runs those too.
unit:
	bash scripts/setup.sh venv
	@status=0; \
	echo "+ ruff check"; $(VENV)/bin/ruff check || status=1; \
	echo "+ mypy agent api"; $(VENV)/bin/mypy agent api || status=1; \
	echo "+ lint-imports"; $(VENV)/bin/lint-imports || status=1; \
	echo "+ pytest -v tests/unit -m 'not tools'"; $(VENV)/bin/pytest -v tests/unit -m "not tools" || status=1; \
	exit $$status

bench: setup
	$(PY) bench/run.py

bench-quick: setup
	$(PY) bench/run.py --quick

bench-latency: setup
	$(PY) bench/latency.py

clean:
	rm -rf $(OUT) demo/build bench/build
