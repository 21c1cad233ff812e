# Two commands on a fresh machine: `make demo` and `make test`. Both create or update .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint format reproduce bench mutation clean

venv: $(STAMP)

# torch is installed first, pinned to the CPU build this environment ships: an unpinned torch
# would pull a multi-GB CUDA build. The simulator itself does not import torch.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[engine,dev]"
	touch $(STAMP)

demo: venv
	$(BIN)/python -m sim.demo

# The paper's experiment and what lies beyond it -> results/paper/ (about 2 minutes on 2 cores).
reproduce: venv
	$(BIN)/python -m sim.reproduce

test: venv
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -p no:cacheprovider --timeout=900

lint: venv
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: venv
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

bench: venv
	$(BIN)/python benchmarks/sim_speed.py

# Mutation testing of policies/ and sim/{engine,latency,metrics}.py (mutmut; settings in
# pyproject.toml): each mutant runs the fast tests that cover its function. Prints the score per
# file and the survivors. Slow (see README, "Mutation testing"); not part of `make test`.
mutation: venv
	env -u PYTHONPATH $(BIN)/mutmut run --max-children 2
	env -u PYTHONPATH $(BIN)/python benchmarks/mutation_score.py

clean:
	rm -rf $(VENV) outputs multirun mutants .pytest_cache .ruff_cache
