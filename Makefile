# Two commands matter:  `make demo` (a real search) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# Machines without an NVIDIA driver (CI, the dev boxes) pin torch 2.13.0, which those machines
# install from a local CPU wheel in seconds; with a driver, `make install` takes the normal torch
# for the platform. Override with TORCH_SPEC=... (empty: let pip choose).
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 || echo torch==2.13.0)
DEMO_ARGS ?= --model gpt2 --gpu-budget 8GiB

.PHONY: install test demo bench clean

$(BIN)/autotune: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(if $(TORCH_SPEC),$(BIN)/pip install -q "$(TORCH_SPEC)")
	$(BIN)/pip install -q -e ".[dev]"
	@touch $@

install: $(BIN)/autotune

test: install
	$(BIN)/python -m pytest -q

demo: install
	$(BIN)/autotune search $(DEMO_ARGS)

bench: install
	$(BIN)/python -m benchmarks.run

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
