# tformer: `make test` and `make demo` each set everything up on a fresh clone.
PYTHON ?= python3
# torch's requirement and the index to take it from: by default the CPU wheel here, and PyPI's build (CUDA
# 13.0 on Linux) elsewhere; another is e.g. TORCH_INDEX=https://download.pytorch.org/whl/cu128 (drivers
# older than 580) or .../whl/cpu
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
TORCH_ARGS := "$(TORCH)"$(if $(TORCH_INDEX), --index-url "$(TORCH_INDEX)")
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_STAMP := $(VENV)/.torch

.DEFAULT_GOAL := help
.PHONY: FORCE help install test test-slow demo multi30k bench readme-images clean

help: ## List the targets
	@grep -hE '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  \033[1m%-10s\033[0m %s\n", $$1, $$2}'

# The torch asked for, kept in the venv: asking for another (TORCH, TORCH_INDEX) reinstalls torch, which
# pip would otherwise leave as it is (the CPU wheel's 2.13.0+cpu already meets torch==2.13.0). The first
# record is dated 1970, so that a venv made before records were kept reinstalls nothing.
$(TORCH_STAMP): FORCE
	@mkdir -p $(VENV)
	@if [ ! -f $@ ]; then echo '$(TORCH_ARGS)' > $@ && touch -t 197001010000 $@; \
	elif ! echo '$(TORCH_ARGS)' | cmp -s - $@; then echo '$(TORCH_ARGS)' > $@; fi

$(STAMP): pyproject.toml $(TORCH_STAMP)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(if $(and $(wildcard $@),$(filter $(TORCH_STAMP),$?)),--force-reinstall )$(TORCH_ARGS)
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

install: $(STAMP) ## Create .venv and install tformer with test tools (TORCH=..., TORCH_INDEX=... pick torch)

TEST_JOBS ?= auto
test: $(STAMP) ## Run the test suite in one process per core (pytest-xdist; TEST_JOBS=N processes, 0 for one)
	$(BIN)/pytest -n $(TEST_JOBS) --dist worksteal

test-slow: $(STAMP) ## Run the slow tests: several processes, kills (a few minutes)
	$(BIN)/pytest -m slow

demo: $(STAMP) ## Train the bundled number-words demo (a few minutes on 2 cores), evaluate it, translate
	$(BIN)/tformer train configs/demo.yaml --overwrite
	$(BIN)/tformer eval runs/demo --split test
	$(BIN)/tformer generate runs/demo "twenty-one" "three hundred forty-two thousand fifteen" "seven hundred"

# Multi30k: local copy by default; MULTI30K=bentrevett/multi30k trains from the hub. DIRECTION=de-en or en-de.
MULTI30K ?= ../shared/data/multi30k
DIRECTION ?= de-en
M30K_CONFIG := configs/multi30k$(if $(filter en-de,$(DIRECTION)),-en-de,).yaml
M30K_RUN := runs/multi30k-$(DIRECTION)
# checkpoints averaged: en-de takes the last 10, as the published result does (validation ties: 41.86 / 41.96 over five runs)
M30K_LAST := $(if $(filter en-de,$(DIRECTION)),10,5)

multi30k: $(STAMP) ## Train one Multi30k direction (about an hour on 2 cores), average, evaluate, plot
	$(BIN)/tformer train $(M30K_CONFIG) --set data.dataset=$(MULTI30K) --output-dir $(M30K_RUN) --overwrite
	$(BIN)/tformer average $(M30K_RUN) --last $(M30K_LAST)
	$(BIN)/tformer eval $(M30K_RUN) --beam-size 1
	$(BIN)/tformer eval $(M30K_RUN)/checkpoints/average-last-$(M30K_LAST) --beam-size 5
	$(BIN)/tformer plot $(M30K_RUN)

BENCH_ARGS ?=
bench: $(STAMP) ## Benchmark tformer against its peers (BENCH_ARGS="--sizes small --workloads train,greedy")
	$(BIN)/pip install --quiet -e ".[bench]"
	$(BIN)/python benchmarks/run.py $(BENCH_ARGS)

readme-images: $(STAMP) ## Redraw the README's images from runs/demo (run `make demo` first)
	$(BIN)/tformer inspect-attention runs/demo "twenty-one thousand three hundred forty-five" --save data/readme/attention-demo.png > /dev/null
	$(BIN)/tformer plot runs/demo --output data/readme/curves-demo.png

# runs/ stays: it holds trained models (make demo's, make multi30k's, tformer train's by default)
clean: ## Remove the venv and caches (runs/ stays)
	rm -rf $(VENV) .pytest_cache build *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
