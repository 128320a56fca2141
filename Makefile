# The README's two commands: `make demo` (the pipeline on the embedded default) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TEST_MARKERS ?= not slow and not device and not sglang

.PHONY: setup interop demo test lint clean gpu-inputs
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
	$(PY) -m pip install -q --no-deps triton==3.9.0  # Triton kernels tested in its CPU interpreter (verify, KL)

# What scripts/gpu_session.sh carries in .gpu (git-ignored; rebuilt here when a checkout lacks it): the three eval
# prompt sets bench decodes, their first 80 prompts each as chat messages (the data step captures the first
# NUM_PROMPTS for the offline side), every eval user turn (the target's own prompts must not repeat one), and the
# training source: 10K ShareGPT first turns (eval prompts excluded) with the coding prompts spread through them.
GPU_INPUTS ?= .gpu
gpu-inputs: setup
	mkdir -p $(GPU_INPUTS)
	for s in mt-bench humaneval sharegpt; do $(VENV)/bin/eaglenest bench prompts --prompt-set $$s --model default \
	  --out $(GPU_INPUTS)/$$s.jsonl || exit 1; done
	$(VENV)/bin/eaglenest bench prompts --format messages --prompt-set mt-bench --prompt-set humaneval \
	  --prompt-set sharegpt --limit 80 --out $(GPU_INPUTS)/calib.jsonl
	$(PY) -c "import json, sys; from eaglenest.speculative.prompts import user_texts; \
	  json.dump(sorted(user_texts(['mt-bench', 'humaneval', 'sharegpt'])), open(sys.argv[1], 'w'))" \
	  $(GPU_INPUTS)/eval-user-texts.json
	$(PY) scripts/pack_prompts.py --out $(GPU_INPUTS)/train-1t.jsonl.xz --count 10000 --max-tokens 2048 \
	  --max-turns 1 --exclude-prompt-set mt-bench --exclude-prompt-set humaneval --exclude-prompt-set sharegpt
	$(PY) scripts/pack_code_prompts.py --out $(GPU_INPUTS)/train-1tc.jsonl.xz --count 4000 \
	  --append-to $(GPU_INPUTS)/train-1t.jsonl.xz --spread
	rm -f $(GPU_INPUTS)/train-1t.jsonl.xz   # (inside train-1tc; .gpu travels whole with a 64-MiB call)

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
