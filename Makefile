# The README's two commands: `make train` (the main job) and `make test` (lint, then the suite:
# tests/unit and tests/integration; `pytest -m "not integration"` runs the fast half alone). Two pytest-xdist
# workers, each test module on one worker (module fixtures are made once): a serial run leaves
# one of CI's 2 cores idle about half the time (launchers waiting, one-rank runs, bounded waits).
# Both create .venv and install harness with pinned torch on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export OMP_NUM_THREADS ?= 2

$(VENV)/.installed: setup.cfg constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[test]"
	touch $@

install: $(VENV)/.installed

train: $(VENV)/.installed
	$(PY) -m harness.train --config configs/default.yaml

test: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadscope --no-loadscope-reorder --durations=15

.PHONY: install train test
