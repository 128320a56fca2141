# The README's two commands: `make demo` (the pipeline on the embedded default) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TEST_MARKERS ?= not slow and not device and not sglang

.PHONY: setup interop demo test lint clean
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0   # the CPU build; an unpinned torch pulls CUDA wheels
	$(PY) -m pip install -q -e ".[dev]"
	$(MAKE) interop
	touch $@

# speculators (vLLM's EAGLE-3 format), for the test that loads our export with its own classes. Its
# requirements would replace transformers (it pins <= 5.19) and add CUDA torchvision/torchaudio, so it goes
# in without dependency resolution, plus exactly what its import chain needs.
# specforge (SpecForge's trainer, for the slow side-by-side tests of scripts/gpu_specforge.py) likewise: it pins
# torch 2.11 and sglang; its offline EAGLE-3 path needs only datasets besides what is here.
interop:
	$(PY) -m pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0 datasets==5.1.0 dill==0.4.1 \
	  multiprocess==0.70.19 xxhash==4.1.0 specforge==0.2.0
	$(PY) -m pip install -q "openai>=2" "loguru==0.7.3" "pandas>=2"

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
