# Two commands do all set-up: `make demo` and `make test`. Both create or reuse
# .venv/ in the repo root. torch is installed first, pinned to the CPU build
# this environment serves, so that no dependency can pull a CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1
export MKL_NUM_THREADS ?= 1
export JAX_PLATFORMS ?= cpu
export XLA_FLAGS ?= --xla_force_host_platform_device_count=1
export MPLBACKEND ?= Agg

.PHONY: demo test test-slow reliability lint venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

test-slow: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m slow

# docs/reliability.md: thousands of generated cases against every public entry point
reliability: $(STAMP)
	$(PY) -m benchmarks.reliability

lint: $(STAMP)
	$(VENV)/bin/ruff check graphs inference probformer tests benchmarks

demo: $(STAMP)
	$(PY) -m probformer demo

clean:
	rm -rf $(VENV) build *.egg-info
