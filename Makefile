# tformer: `make test` and `make demo` each set everything up on a fresh clone.
PYTHON ?= python3
# The CPU wheel by default; a GPU user runs e.g. `make install TORCH=torch==2.13.0` with a CUDA index.
TORCH ?= torch==2.13.0
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.DEFAULT_GOAL := help
.PHONY: help install test demo clean

help: ## List the targets
	@grep -hE '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  \033[1m%-10s\033[0m %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

install: $(STAMP) ## Create .venv and install tformer with test tools (TORCH=... to pick the wheel)

test: $(STAMP) ## Run the test suite
	$(BIN)/pytest

demo: $(STAMP) ## Train the bundled number-words demo (a few minutes on 2 cores), evaluate it, translate
	$(BIN)/tformer train configs/demo.yaml --overwrite
	$(BIN)/tformer eval runs/demo --split test
	$(BIN)/tformer generate runs/demo "twenty-one" "three hundred forty-two thousand fifteen" "seven hundred"

clean: ## Remove the venv, caches and runs
	rm -rf $(VENV) runs .pytest_cache build *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
