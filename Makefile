# heapscope: `make demo` shows it working, `make test` checks it. Both run `make setup` first,
# which is idempotent (see scripts/setup.sh) and takes about a second once everything is in place.

VENV      := .venv
PY        := $(VENV)/bin/python
HEAPSCOPE := $(VENV)/bin/heapscope
CC        := gcc
OUT       := out

.PHONY: setup demo test lint bench bench-quick clean

setup:
	bash scripts/setup.sh

# The demo workload: frame pointers and -O1 so the trees show each level of calls.
demo/build/phases: demo/phases.c | setup
	mkdir -p demo/build
	$(CC) -g -O1 -fno-omit-frame-pointer -o $@ $<

demo: setup demo/build/phases
	mkdir -p $(OUT)
	$(HEAPSCOPE) run --time-unit=ms --massif-out-file=$(OUT)/massif.out.phases -- demo/build/phases
	ms_print $(OUT)/massif.out.phases

lint: setup
	$(VENV)/bin/ruff check
	$(VENV)/bin/mypy agent api

# All three run even if one fails, so a CI log shows every problem at once; any failure fails the target,
# including pytest's exit code 5 (no tests collected).
test: setup
	@status=0; \
	echo "+ ruff check"; $(VENV)/bin/ruff check || status=1; \
	echo "+ mypy agent api"; $(VENV)/bin/mypy agent api || status=1; \
	echo "+ pytest -v tests"; $(VENV)/bin/pytest -v tests || status=1; \
	exit $$status

bench: setup
	$(PY) bench/run.py

bench-quick: setup
	$(PY) bench/run.py --quick

clean:
	rm -rf $(OUT) demo/build bench/build
