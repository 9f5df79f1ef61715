# The two commands of the README: `make run` and `make test`. Both set up .venv first.
VENV ?= .venv
PYTHON ?= python3
# CPU build on machines without a GPU; on a CUDA machine pass e.g. TORCH='torch>=2.4'.
TORCH ?= torch==2.13.0
CORES ?= 8
BIN := $(VENV)/bin

.PHONY: setup run run-harness run-trainer test lint

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e '.[dev,slurm]'
	touch $@

# the embedded default as people train it: the SFTTrainer of examples/sft_trainer.py
run: setup
	. $(BIN)/activate && snakemake --cores $(CORES) report --configfile config/trainer.yaml

# the same model and data through the reference harness (profile.harness) instead
run-harness: setup
	. $(BIN)/activate && snakemake --cores $(CORES) report

# the trainer run's earlier name, kept for scripts that call it
run-trainer: run

# two workers (a 2-core CI machine: 12.5 -> 8 min); tests that share a module fixture with
# side effects (the SLURM cluster) are grouped onto one worker
test: setup
	. $(BIN)/activate && pytest -n 2 --dist loadgroup --durations=15

lint: setup
	. $(BIN)/activate && ruff check scripts tests bench tools examples && ruff format --check scripts tests bench tools examples \
		&& snakefmt --check Snakefile workflow && snakemake --lint
