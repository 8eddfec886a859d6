# ppctl: the commands the README names.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
export HF_DATASETS_OFFLINE := 1
export HF_HUB_OFFLINE := 1

.PHONY: setup test test-fast run smoke bench clean

setup: $(STAMP)  ## create .venv and install ppctl (editable) with its test extra; quick when done

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $(STAMP)

test: setup  ## the whole suite: unit, multi-process (gloo) and end-to-end CLI tests
	$(BIN)/python -m pytest -q

test-fast: setup  ## unit tests only (no processes)
	$(BIN)/python -m pytest -q tests/unit

run: setup  ## the main job: train the default config on the embedded default dataset
	$(BIN)/ppctl train

smoke: setup  ## a few steps of the 8-rank layout on synthetic data
	$(BIN)/ppctl train model=gpt_tiny data=synthetic parallel=tp2_pp2_dp2 trainer.max_steps=3

bench: setup  ## measured comparisons (prints tables; asserts nothing)
	$(BIN)/python benchmarks/pp1_overhead.py

clean:
	rm -rf runs .pytest_cache
