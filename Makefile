# gpuwarden: every target installs what it needs by itself (a virtualenv in .venv).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROTO_SRC := $(wildcard proto/*.proto)

.PHONY: install run test check format lint types layers bench schemas proto clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/gpuwarden run

test: install
	$(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

check: install format lint types layers
	$(BIN)/python -m shared.contract.schemas --check
	$(BIN)/python -m services.scaler.protogen --check
	$(BIN)/python -m services.device.protogen --check

format: install
	$(BIN)/ruff format --check shared services tests bench

lint: install
	$(BIN)/ruff check shared services tests bench

types: install
	$(BIN)/mypy shared services bench

layers: install
	$(BIN)/lint-imports

bench: install
	$(BIN)/python -m bench.bus $(BENCH_ARGS)
	$(BIN)/python -m bench.checkpoint $(BENCH_ARGS)
	$(BIN)/python -m bench.scaler $(BENCH_ARGS)
	$(BIN)/python -m bench.metrics $(BENCH_ARGS)

schemas: install
	$(BIN)/python -m shared.contract.schemas

proto: install
	$(BIN)/python -m services.scaler.protogen
	$(BIN)/python -m services.device.protogen

clean:
	rm -rf $(VENV) bench/results .mypy_cache .ruff_cache .pytest_cache
