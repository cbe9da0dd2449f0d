"""The tests mirror the packages: the tests of ``graphs/topology/reader.py`` live in
``tests/graphs/topology/test_reader.py``, those of ``inference/mean_field/kernels/fused/`` in
``tests/inference/mean_field/kernels/fused/``. Each test file tests one module (or one
subpackage, and is then named after it); a module with more tests than one file holds gets a
folder of its own (``tests/inference/mean_field/engine/``).

Laws that hold across every engine or every model kind, and checks of the repository itself,
live at this top level: padding invariance, the posterior contract, non-finite input and
weights, compiling and running every model kind without a host sync, docs, examples, layout,
reliability, processes, the GPU check and the convergence study.

Helpers that more than one file uses live in ``builders.py`` (CRFs, batches, configs, kernel
inputs), ``oracles.py`` (answers computed independently of the library), ``strategies.py``
(hypothesis strategies) and the conftest fixtures; helpers that only the files of one folder
share live beside them, in a module named for what it holds
(``tests/probformer/deploy/reader/crafting.py``). No test file imports another. Every folder
is a package, so test basenames may repeat across folders."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("MPLBACKEND", "Agg")

import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Oversubscribed threads on 2 shared cores have made runs 50x slower.
torch.set_num_threads(1)

settings.register_profile(
    "default",
    deadline=None,
    derandomize=True,  # CI sees the same examples every run
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("default")

# folders whose files share a package-scoped fixture that takes minutes to build (every model
# kind exported to every format): their files run in one process, so it is built once
SHARED_FIXTURE_FOLDERS = ("tests/probformer/deploy/exporter/", "tests/probformer/deploy/reader/")


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` sends whole files to a process; a folder of ``SHARED_FIXTURE_FOLDERS``
    goes whole. Other modes keep pytest-xdist's own scheduler."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FilesAndSharedFolders(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return next((folder for folder in SHARED_FIXTURE_FOLDERS if path.startswith(folder)), path)

    return FilesAndSharedFolders(config, log)
