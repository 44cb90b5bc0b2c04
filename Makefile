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
# same search on CPU, sized to finish in a few minutes: shorter blocks, fp32, and a budget that
# sits between configs (gpt2's weights, gradients and AdamW state alone take 1.85 GiB), so that
# some probes run out of memory against it for real.
GPU_DEMO_ARGS := --model gpt2 --gpu-budget 8GiB
CPU_DEMO_ARGS := --model gpt2 --gpu-budget 2.45GiB --device cpu --block-sizes 64 --micro-batches 1,2,4,8 \
                 --effective-batch 8 --precisions fp32 --checkpointing off,on --attention sdpa \
                 --measure-steps 2 --timeout 4m
DEMO_ARGS ?= $(if $(HAVE_NVIDIA),$(GPU_DEMO_ARGS),$(CPU_DEMO_ARGS))
BENCH_ARGS ?=

.PHONY: install test test-fast demo bench clean

$(BIN)/autotune: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(if $(TORCH_SPEC),$(BIN)/pip install -q "$(TORCH_SPEC)")
	$(BIN)/pip install -q -e ".[dev]"
	@touch $@

install: $(BIN)/autotune

# Both cores: one pytest worker each; a file's tests stay on one worker, so a module's warm probe
# child or PostgreSQL server is started once.
PYTEST := $(BIN)/python -m pytest -q -n 2 --dist loadfile

test: install
	$(PYTEST)

# Under a minute: no probe or estimator processes (tests marked `slow`; tests/conftest.py refuses
# them elsewhere). Spread test by test, since no module here shares a costly fixture.
test-fast: install
	$(BIN)/python -m pytest -q -n 2 --dist load -m "not slow"

demo: install
	$(BIN)/autotune search $(DEMO_ARGS)

# On a GPU: gpt2 under 8 GiB and gpt2-medium under 16 GiB; without one: the same pipeline on a
# tiny model. E.g. make bench BENCH_ARGS="--models gpt2 --out /tmp/bench"
bench: install
	$(BIN)/python -m benchmarks.run $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
