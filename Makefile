# cdcd — every target installs what it needs first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: install test lint bench bench-pg run clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@bash scripts/ensure-java.sh
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	@touch $(STAMP)

test: install
	$(BIN)/pytest -q

lint: install
	$(BIN)/ruff check cdcd tests
	$(BIN)/mypy

bench: install
	$(BIN)/python -m tests.bench.run

# cdcd and a private PostgreSQL cluster side by side (ARGS="--quick" for a few minutes).
bench-pg: install
	@bash scripts/ensure-postgres.sh
	$(BIN)/python -m tests.bench.bench_pg $(ARGS)

run: install
	$(BIN)/cdcd demo --rate 2000

clean:
	rm -rf var .pytest_cache .mypy_cache .ruff_cache
