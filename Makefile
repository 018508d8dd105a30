# Nebula developer entry points. `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install proto check-proto check-layers demo test test-unit test-integration lint format clean bench

install: $(STAMP)

# torch goes first, pinned: an unpinned resolve would pull several GB of CUDA wheels.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "torch==$(TORCH_VERSION)"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

proto: $(STAMP)
	$(BIN)/python tools/gen_proto.py

check-proto: $(STAMP)
	$(BIN)/python tools/gen_proto.py --check

# Imports point down only (library -> services -> sdk/cli/launcher) and form no circle.
check-layers: $(STAMP)
	$(BIN)/python tools/check_layers.py

demo: $(STAMP)
	$(BIN)/nebula demo --json runs/demo-summary.json

# Codec benchmark on one core: JSON + markdown in bench-results/ (a few minutes; never part of `make test`).
bench: $(STAMP)
	$(BIN)/nebula codec bench --out bench-results
	$(BIN)/python bench/runtime/pipeline_schedules.py --out bench-results/runtime
	$(BIN)/python bench/runtime/electra_wait.py --out bench-results/runtime
	$(BIN)/python bench/runtime/abnet_bleu.py --out bench-results/runtime

test: $(STAMP)
	$(BIN)/python tools/gen_proto.py --check
	$(BIN)/python tools/check_layers.py
	$(BIN)/ruff check .
	$(BIN)/pytest -q $(PYTEST_ARGS)

test-unit: $(STAMP)
	$(BIN)/pytest -q tests/unit $(PYTEST_ARGS)

test-integration: $(STAMP)
	$(BIN)/pytest -q tests/integration $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
