# The README's two commands: `make demo` (the pipeline on the embedded default) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TEST_MARKERS ?= not slow and not device and not sglang

.PHONY: setup demo test lint clean
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0   # the CPU build; an unpinned torch pulls CUDA wheels
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

demo: setup
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(PY) -m flows.pipeline --demo --out runs/demo

test: setup
	$(PY) -m ruff check eaglenest tasks flows deployments tests scripts
	$(VENV)/bin/hadolint Dockerfile
	$(PY) -m pytest -q -m "$(TEST_MARKERS)"

lint: setup
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
