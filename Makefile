# `make demo` and `make test` each bootstrap .venv (pinned CPU stack) on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

COMPAT_VENV := .venv-compat
COMPAT_PY := $(COMPAT_VENV)/bin/python
COMPAT_STAMP := $(COMPAT_VENV)/.installed

.PHONY: demo test test-slow test-compat test-latest lint bench venv venv-compat clean

venv: $(STAMP)
venv-compat: $(COMPAT_STAMP)

# Each environment: torch's CPU build from local disk first (never an unpinned torch), then its pinned stack.
# .venv: requirements-cpu.txt. .venv-compat: the versions unsloth and the GPU image need (transformers 5.17,
# trl 1.15, datasets 4), requirements-compat.txt.
$(STAMP): REQUIREMENTS := requirements-cpu.txt
$(STAMP): requirements-cpu.txt
$(COMPAT_STAMP): REQUIREMENTS := requirements-compat.txt
$(COMPAT_STAMP): requirements-compat.txt
$(STAMP) $(COMPAT_STAMP): %/.installed: pyproject.toml
	test -x $*/bin/python || $(PYTHON) -m venv $*
	$*/bin/python -m pip install -q --upgrade pip
	$*/bin/python -m pip install -q torch==2.13.0
	$*/bin/python -m pip install -q -r $(REQUIREMENTS)
	$*/bin/python -m pip install -q --no-deps -e .
	touch $@

demo: $(STAMP)
	$(VENV)/bin/longpeft demo --out runs/demo

# Every test target runs one pytest worker per core (pytest-xdist), each worker on one torch thread (tests/conftest.py).
test: $(STAMP)
	$(PY) -m pytest -q -n auto --dist worksteal -m "not slow and not launch_matrix" tests

# ruff's lint rules and its formatter, with the settings of pyproject.toml ([tool.ruff]); CI runs it.
# `ruff format longpeft scripts tests` formats a change before it is committed.
lint: $(STAMP)
	$(VENV)/bin/ruff check longpeft scripts tests
	$(VENV)/bin/ruff format --check longpeft scripts tests

# The tests `make test` leaves out for their time (markers `slow` and `launch_matrix`): run them when you change
# what they cover (the launch matrix: anything in recipes/, launch/ or scale/ that multi-process runs go through).
# It also runs the property tests (marker `property`, Hypothesis) again, with ten times the examples of make test.
test-slow: $(STAMP)
	HYPOTHESIS_PROFILE=slow $(PY) -m pytest -q -n auto --dist worksteal -m "slow or launch_matrix or property" tests

# The recipe, load and merge tests (marker `compat`) on the older stack of requirements-compat.txt, less the slow
# ones and the multi-process launch matrix (markers `slow`, `launch_matrix`), as make test.
test-compat: $(COMPAT_STAMP)
	$(COMPAT_PY) -m pytest -q -n auto --dist worksteal -m "compat and not slow and not launch_matrix" tests

# The newest release of every package of requirements-cpu.txt except torch (held at the CPU build on local disk by
# a constraint): what `pip install longpeft` gives a user today. Rebuilt on each call, not run by CI (it depends on
# what the registry has that day); run it when transformers, peft, trl or accelerate release.
LATEST_VENV := .venv-latest
test-latest:
	rm -rf $(LATEST_VENV)
	$(PYTHON) -m venv $(LATEST_VENV)
	echo "torch==2.13.0" > $(LATEST_VENV)/constraints.txt
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade pip
	$(LATEST_VENV)/bin/python -m pip install -q torch==2.13.0
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade -c $(LATEST_VENV)/constraints.txt \
		$$(sed -e 's/#.*//' -e 's/[=<>].*//' requirements-cpu.txt | grep -vx 'torch' | tr -s ' \n' ' ')
	$(LATEST_VENV)/bin/python -m pip install -q --no-deps -e .
	$(LATEST_VENV)/bin/python -m pip list --format=freeze | grep -iE '^(transformers|peft|trl|accelerate|datasets|bitsandbytes)=='
	$(LATEST_VENV)/bin/python -m pytest -q tests

# bench_beacon_authors.py is left out: it needs the authors' code in a second environment (see its docstring).
bench: $(STAMP)
	@for script in $(filter-out scripts/bench_beacon_authors.py,$(wildcard scripts/bench_*.py)); do \
		echo "== $$script"; $(PY) $$script || exit 1; done

clean:
	rm -rf $(VENV) $(COMPAT_VENV) $(LATEST_VENV) runs build *.egg-info
