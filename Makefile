# Every target installs what it needs into .venv on its own.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MODEL ?= $(firstword $(wildcard ../shared/models/stories260K))
PROMPT ?= Once upon a time
TORCH_PIN := torch==2.13.0

LIPS := $(patsubst %.c,%.wasm,$(wildcard lips/*.c))
ZIGCC := $(PY) -m ziglang cc --target=wasm32-wasi -O2 -s -I guest_sdk/c

.PHONY: install lips run generate test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU wheel first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

# Every C example in lips/, built with zig's wasm32-wasi clang (installed by pip as ziglang).
lips: $(LIPS)

lips/%.wasm: lips/%.c guest_sdk/c/symphony.h | $(VENV)/.installed
	$(ZIGCC) $< -o $@

run: lips
	@test -n "$(MODEL)" || { echo "no model: pass MODEL=DIR (a Hugging Face directory)"; exit 2; }
	$(VENV)/bin/symphony run --model $(MODEL) --stats lips/hello.wasm -- "$(PROMPT)" 60

generate: install
	@test -n "$(MODEL)" || { echo "no model: pass MODEL=DIR (a Hugging Face directory)"; exit 2; }
	$(VENV)/bin/symphony generate --model $(MODEL) --prompt "$(PROMPT)" --max-tokens 60

test: lips
	$(PY) -m pytest -q

bench: install
	$(PY) bench/engine.py

clean:
	rm -rf $(VENV) build *.egg-info lips/*.wasm
