# Two entry points: `make run` (the demo job) and `make test` (the whole suite).
# Each creates .venv and installs what it needs; torch is pinned to the CPU build.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test install dev bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.dev-installed: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed
dev: $(VENV)/.dev-installed

run: install
	$(BIN)/raysc demo

test: dev
	$(BIN)/python -m pytest -q

$(VENV)/.bench-installed: $(VENV)/.dev-installed
	$(BIN)/pip install -q -e '.[dev,bench]'
	touch $@

bench: $(VENV)/.bench-installed
	$(BIN)/python benchmarks/train_overhead.py
	$(BIN)/python benchmarks/parallel.py
	$(BIN)/python benchmarks/checkpoint.py
	$(BIN)/python benchmarks/recovery.py
	$(BIN)/python benchmarks/dedup.py
	$(BIN)/python benchmarks/loader.py

clean:
	rm -rf $(VENV) runs .cache
