# Two commands matter:  `make demo` (a real search) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# Machines without an NVIDIA driver (CI, the dev boxes) pin torch 2.13.0, which those machines
# install from a local CPU wheel in seconds; with a driver, `make install` takes the normal torch
# for the platform. Override with TORCH_SPEC=... (empty: let pip choose).
HAVE_NVIDIA := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo yes)
TORCH_SPEC ?= $(if $(HAVE_NVIDIA),,torch==2.13.0)

# The README's main command. With a GPU: the real question, gpt2 under 8 GiB. Without one, the
# same kind of search on CPU, sized to finish in about a minute on 2 idle cores (4-5 on busy ones;
# --timeout holds it to 5 minutes, and the same command goes on): a GPT-2 of 6 layers, 384 wide
# (30M parameters, gpt2's vocabulary and positions), and a budget that sits between configs, so
# that one really runs out of memory and checkpointing competes with accumulation: under 800 MiB
# (760 allowed after the 5% margin), micro-batch 8 without checkpointing is predicted at 792.5 MiB,
# over what is allowed but not over the budget, so a probe decides (and runs out of memory).
DEMO_MODEL := $(VENV)/demo-gpt2
DEMO_CONFIG := {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 6, "n_embd": 384, \
               "n_head": 6, "vocab_size": 50257, "n_positions": 1024, "n_ctx": 1024, "bos_token_id": 50256, \
               "eos_token_id": 50256}
GPU_DEMO_ARGS := --model gpt2 --gpu-budget 8GiB
CPU_DEMO_ARGS := --model $(DEMO_MODEL) --gpu-budget 800MiB --device cpu --block-sizes 64 --micro-batches 1,2,4,8 \
                 --effective-batch 8 --precisions fp32 --checkpointing off,on --attention sdpa --measure-seconds 3 \
                 --timeout 5m
DEMO_ARGS ?= $(if $(HAVE_NVIDIA),$(GPU_DEMO_ARGS),$(CPU_DEMO_ARGS))
BENCH_ARGS ?=

.PHONY: install test test-fast lint format demo serve bench clean

$(BIN)/autotune: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(if $(TORCH_SPEC),$(BIN)/pip install -q "$(TORCH_SPEC)")
	$(BIN)/pip install -q -e ".[dev]"
	@touch $@

install: $(BIN)/autotune

# Both cores: one pytest worker each. A module's tests stay on one worker, so that a fixture made once
# for the module (a warm probe child, a server, a search) is made once; the longest modules go first
# (tests/conftest.py orders them by tests/module_seconds.json; --no-loadscope-reorder keeps that
# order), so that neither worker is left alone with a long module at the end.
PYTEST := $(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25

# Bytecode first: where PYTHONDONTWRITEBYTECODE is set (as on the CI machines), every Python process
# the suite starts (some 400: commands, fork servers, ranks) would compile autotune's sources again,
# about 0.2 s of CPU each.
BYTECODE := $(BIN)/python -m compileall -q -j 0 autotune tests benchmarks >/dev/null

test: install
	$(BYTECODE)
	$(PYTEST)

# pyflakes' checks and the formatter's layout (pyproject's [tool.ruff]); tests/test_layout.py runs
# the same in `make test`. `make format` writes the layout.
lint: install
	$(BIN)/ruff check autotune tests benchmarks
	$(BIN)/ruff format --check autotune tests benchmarks

format: install
	$(BIN)/ruff format autotune tests benchmarks

# About a minute: no probe or estimator processes (tests marked `slow`; tests/conftest.py refuses
# them elsewhere).
test-fast: install
	$(BYTECODE)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not slow"

$(DEMO_MODEL)/config.json:
	mkdir -p $(DEMO_MODEL)
	printf '%s\n' '$(DEMO_CONFIG)' > $@

demo: install $(DEMO_MODEL)/config.json
	$(BIN)/autotune search $(DEMO_ARGS)

# The service on http://127.0.0.1:8000/ over the same embedded database, with a queue worker on this
# machine (the GPU if there is one, else --worker-device cpu), reads open to the page. A token named
# "local" is made (and printed) once; keep it for POST /v1/searches. SERVE_ARGS=... to change.
SERVE_ARGS ?= --local-worker --public-read $(if $(HAVE_NVIDIA),,--worker-device cpu)
serve: install
	@$(BIN)/autotune token list 2>/dev/null | grep -q '^local\b' || $(BIN)/autotune token create local
	$(BIN)/autotune serve $(SERVE_ARGS)

# On a GPU: gpt2 under 8 GiB and gpt2-medium under 16 GiB; without one: the same pipeline on a
# tiny model. E.g. make bench BENCH_ARGS="--models gpt2 --out /tmp/bench"
bench: install
	$(BIN)/python -m benchmarks.run $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
