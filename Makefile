# ppctl: the commands the README names.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
export HF_DATASETS_OFFLINE := 1
export HF_HUB_OFFLINE := 1

# `test` runs the suite in TEST_WORKERS pytest processes (pytest-xdist; the Slurm tests share one, with their
# cluster): alone, the suite kept about one of two cores busy, its tests waiting on process starts, rendezvous
# and Slurm's scheduler as often as they compute.
TEST_WORKERS ?= 2
# `test` also compiles ppctl first: the suite starts a few hundred Python processes (CLI, torchrun workers) that
# each import it, and where PYTHONDONTWRITEBYTECODE is set none would write the bytecode the next could reuse
# (half a second of CPU each).
.PHONY: setup test test-fast gpu-check run smoke bench clean slurm-setup fuzz

setup: $(STAMP)  ## create .venv and install ppctl (editable) with its test extra; quick when done

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $(STAMP)

test: setup  ## the whole suite: unit, multi-process (gloo) and end-to-end CLI tests, in TEST_WORKERS pytest processes
	$(BIN)/python -m compileall -q ppctl > /dev/null
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

test-fast: setup  ## unit tests only (no processes)
	$(BIN)/python -m pytest -q tests/unit

# `fuzz`: N configurations drawn at random from seed SEED, each proven equal to one process (tests/fuzz/run.py);
# a failure prints the seed and the `ppctl verify` line that reproduces it. N is 1 or more, SEED 0 or more (else one
# line, exit 2).
SEED ?= 0
N ?= 20
fuzz: setup  ## the composition fuzzer: make fuzz SEED=1 N=100
	$(BIN)/python -m tests.fuzz.run --seed $(SEED) --count $(N)

gpu-check: setup  ## on a machine with GPUs: the NCCL path against gloo (tests/gpu; prints gpt_small's bf16 MFU), then the equivalence suite under NCCL (a GPU per rank; worlds larger than the GPUs skip)
	$(BIN)/python -m pytest -q -rs tests/gpu
	PPCTL_TEST_BACKEND=nccl $(BIN)/python -m pytest -q -rs -m nccl tests/distributed

run: setup  ## the main job: train the default config on the embedded default dataset
	$(BIN)/ppctl train

smoke: setup  ## a few steps of the 8-rank layout on synthetic data
	$(BIN)/ppctl train model=gpt_tiny data=synthetic parallel=tp2_pp2_dp2 trainer.max_steps=3

PP1_SIZES = model.num_layers=4 model.hidden_size=256 model.num_heads=8 model.ffn_hidden_size=1024 \
	trainer.seq_length=128 trainer.global_batch_size=16 trainer.micro_batch_size=4

bench: setup  ## measured comparisons (prints tables; asserts nothing): pp=1 against a plain loop, pp=2 against torch
	$(BIN)/ppctl bench parallel=single data=synthetic --against plain --steps 8 --repeats 5 $(PP1_SIZES)
	$(BIN)/ppctl bench parallel.pp=2 data=synthetic --against torch --steps 5 --repeats 5 --schedules 1f1b,gpipe

# tests/slurm runs its cluster with auth/none, so munged is never started (apt brings munge along anyway).
SLURM_PACKAGES = slurmctld slurmd slurm-client

slurm-setup:  ## as root: install Slurm (slurmctld, slurmd, clients) from apt for tests/slurm's local cluster; quick when installed
	@if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null; then \
		echo "slurm-setup: slurmctld, slurmd and sbatch already installed"; \
	else \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(SLURM_PACKAGES); \
	fi

clean:
	rm -rf runs .pytest_cache
