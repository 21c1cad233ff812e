# Two commands on a fresh machine: `make demo` and `make test`. Both create or update .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test lint format reproduce validate validate-workloads bench mutation clean \
	test-tf517 gpu-bundle gpu-check-dry

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

# The paper's experiment and what lies beyond it -> results/paper/ (about 4.5 minutes on 2 idle cores).
reproduce: venv
	$(BIN)/python -m sim.reproduce

# Simulator vs real engine on this machine, every tiny preset -> the curated
# results/validation/<model>-<device>/ and results/validation/summary.md (a plain
# `qllm-validate` writes results/validation-runs/ instead). About 5 minutes per model. On
# CPU time (clock=cpu): this machine is shared, and wall time counts the others' work.
TINY_MODELS := tiny-mixtral tiny-qwen2-moe tiny-qwen3-moe tiny-olmoe tiny-deepseek-v3
validate: venv
	for m in $(TINY_MODELS); do $(BIN)/qllm-validate model=$$m out_dir=results/validation \
		clock=cpu device=cpu progress=false || exit 1; done
	$(BIN)/python -m realrun.validation_table results/validation | tee results/validation/summary.md

# The simulator on the workloads validate is not sized for: HumanEval's prompts and outputs,
# and ShareGPT's prompts with outputs capped at 50 tokens (as the paper's reproduction runs
# them), on tiny-mixtral -> the curated results/validation-workloads/ and its summary.md.
# About 17 minutes (16 to 17.5 measured).
WORKLOADS := humaneval sharegpt
validate-workloads: venv
	for w in $(WORKLOADS); do $(BIN)/qllm-validate workload=$$w name=tiny-mixtral-$$w \
		$$([ $$w = sharegpt ] && echo workload.max_output_tokens=50) \
		out_dir=results/validation-workloads clock=cpu device=cpu progress=false || exit 1; done
	$(BIN)/python -m realrun.validation_table results/validation-workloads \
		| tee results/validation-workloads/summary.md

test: venv
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -p no:cacheprovider --timeout=900
	$(MAKE) --no-print-directory test-tf517 gpu-check-dry

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
	rm -rf $(VENV) outputs multirun mutants .pytest_cache .ruff_cache .cache gpu/bundle

# --- The GPU machine (an H200 with transformers 5.17.0, no registry): see README, "GPU check".
# transformers 5.17.0 (the GPU machine's) in an ignored target dir, ahead of the venv's newer one;
# huggingface-hub<2 and its httpx are what 5.17 needs beside the venv's packages.
TF517 := .cache/tf517
$(TF517)/.installed: Makefile
	rm -rf $(TF517)
	$(BIN)/python -m pip install -q --no-deps --target $(TF517) transformers==5.17.0 \
		huggingface-hub==1.33.0 httpx==0.28.1 httpcore==1.0.9
	touch $@

# The exactness tests (tokens equal model.generate) against transformers 5.17.0.
test-tf517: venv $(TF517)/.installed
	PYTHONPATH=$(CURDIR)/$(TF517):$(CURDIR) $(BIN)/python -c \
		"import transformers as t; assert t.__version__ == '5.17.0', t.__version__"
	PYTHONPATH=$(CURDIR)/$(TF517):$(CURDIR) $(BIN)/python -m pytest -p no:cacheprovider \
		--timeout=300 tests/test_ops.py tests/test_realrun.py -k "test_ops or greedy_tokens"

# Pure-Python wheels of what the project imports that the GPU machine lacks (gpu/bundle.txt);
# antlr4-python3-runtime 4.9.3 has no wheel on the index: built from its sdist.
GPU_BUNDLE := gpu/bundle
$(GPU_BUNDLE)/.done: gpu/bundle.txt
	rm -rf $(GPU_BUNDLE) && mkdir -p $(GPU_BUNDLE)
	grep -v '^#' gpu/bundle.txt | grep -v antlr4 | xargs $(BIN)/python -m pip download -q \
		--no-deps --only-binary=:all: --python-version 3.12 --implementation py --platform any \
		-d $(GPU_BUNDLE)
	grep '^antlr4' gpu/bundle.txt | xargs $(BIN)/python -m pip wheel -q --no-deps -w $(GPU_BUNDLE)
	du -sh $(GPU_BUNDLE)
	test $$(du -sk $(GPU_BUNDLE) | cut -f1) -le 20480 || { echo "$(GPU_BUNDLE) over 20 MiB"; false; }
	touch $@
gpu-bundle: venv $(GPU_BUNDLE)/.done

# gpu/check.sh on the CPU with a tiny model, the GPU machine's packages simulated.
gpu-check-dry: gpu-bundle $(TF517)/.installed
	rm -rf results/gpu-check-dry
	OUT=results/gpu-check-dry QLLM_CHECK_DRY=1 PYTHON=$(BIN)/python \
		QLLM_CHECK_PYTHONPATH=$(CURDIR)/$(TF517) gpu/check.sh
