"""Every benchmark module imports: a benchmark that reads a test module's constants (the
kill-and-resume loop reads the tests' tiny run) breaks when that module moves, and its own
run is behind ``make test-slow`` or a GPU, so nothing else would notice."""

import importlib
import pkgutil

import pytest

import benchmarks

MODULES = [
    module.name
    for module in pkgutil.walk_packages(benchmarks.__path__, "benchmarks.")
    if not module.name.endswith("__main__")  # a package's __main__ runs its job on import
]


@pytest.mark.parametrize("name", MODULES)
def test_the_benchmark_module_imports(name):
    importlib.import_module(name)
