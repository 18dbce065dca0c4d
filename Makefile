# pipespec — the two commands a new user runs: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.pipespec-installed
# Stage processes share the cores: one intra-op thread each avoids oversubscription (10x slower otherwise).
export OMP_NUM_THREADS ?= 1

.PHONY: demo test lint zoo bench clean venv

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first, pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/pipespec demo

test: $(STAMP)
	$(BIN)/ruff check sdk codemods tests bench
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

zoo: $(STAMP)
	$(BIN)/pipespec zoo --write-coverage docs/coverage.md

bench: $(STAMP)
	$(BIN)/pipespec bench all --quick

clean:
	rm -rf $(VENV) build *.egg-info sdk/*.egg-info
