# `make demo` and `make test` each bootstrap .venv (pinned CPU stack) on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

COMPAT_VENV := .venv-compat
COMPAT_PY := $(COMPAT_VENV)/bin/python
COMPAT_STAMP := $(COMPAT_VENV)/.installed

.PHONY: demo test test-compat bench venv venv-compat clean

venv: $(STAMP)
venv-compat: $(COMPAT_STAMP)

$(STAMP): pyproject.toml requirements-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements-cpu.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

# The versions unsloth and the GPU image need (transformers 5.17, trl 1.15, datasets 4): requirements-compat.txt.
$(COMPAT_STAMP): pyproject.toml requirements-compat.txt
	test -x $(COMPAT_PY) || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_PY) -m pip install -q --upgrade pip
	$(COMPAT_PY) -m pip install -q torch==2.13.0
	$(COMPAT_PY) -m pip install -q -r requirements-compat.txt
	$(COMPAT_PY) -m pip install -q --no-deps -e .
	touch $(COMPAT_STAMP)

demo: $(STAMP)
	$(VENV)/bin/longpeft demo --out runs/demo

test: $(STAMP)
	$(PY) -m pytest -q tests

# The recipe, load and merge tests (marker `compat`) on the older stack of requirements-compat.txt.
test-compat: $(COMPAT_STAMP)
	$(COMPAT_PY) -m pytest -q -m compat tests

bench: $(STAMP)
	@for script in scripts/bench_*.py; do echo "== $$script"; $(PY) $$script || exit 1; done

clean:
	rm -rf $(VENV) $(COMPAT_VENV) runs build *.egg-info
