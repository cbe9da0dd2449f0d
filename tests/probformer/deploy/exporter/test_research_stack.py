"""Exported models need only torch (and probformer's own torch code): every kind's torch
folder and ONNX file run, in a fresh process, where pyro, numpyro, jax, arviz and networkx
cannot be imported, and its ``.pt2`` where all but networkx cannot (torch.export.load
imports networkx), giving the source model's logits."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from tests.probformer.deploy.exporter.tiny_models import KINDS, batches

# ---- exported models need only torch (and probformer's own torch code) -------------------

BLOCKER = """
import importlib.abc, importlib.machinery, sys
BLOCKED = {blocked!r}
class Absent(importlib.abc.Loader):  # as if not installed: find_spec finds no origin, import fails
    def create_module(self, spec):
        raise ModuleNotFoundError(f"No module named {{spec.name!r}} (blocked in this test)", name=spec.name)
    def exec_module(self, module):
        pass
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            return importlib.machinery.ModuleSpec(name, Absent())
sys.meta_path.insert(0, Blocker())
"""


RUN = """
import json, torch
from safetensors.torch import load_file
import probformer
io = load_file({io!r})
for kind, paths in json.loads({paths!r}).items():
    expected = io[kind]
    for format, path in paths.items():
        found = probformer.load(path)(io["tokens"], io["mask"].bool())
        error = (found - expected).abs().max().item()
        assert error <= 1e-5, (kind, format, error)
        print("ran", kind, format)
heavy = sorted(set(BLOCKED) & {{m.split(".")[0] for m in sys.modules}})
assert not heavy, heavy
print("ran without", {blocked!r})
"""


@pytest.mark.parametrize(
    "formats, blocked",
    [
        (["torch", "onnx"], ["pyro", "numpyro", "jax", "arviz", "networkx", "xarray"]),
        # torch.export.load itself imports networkx (a dependency of torch, not of probformer)
        (["exported"], ["pyro", "numpyro", "jax", "arviz", "xarray"]),
    ],
)
def test_every_export_runs_where_the_research_stack_cannot_be_imported(every_export, tmp_path, formats, blocked):
    models, paths = every_export
    tokens, mask = list(batches())[2]
    io = {"tokens": tokens, "mask": mask.to(torch.uint8)}
    with torch.no_grad():
        io.update({kind: model(tokens, mask)[0].contiguous() for kind, model in models.items()})
    save_file(io, str(tmp_path / "io.safetensors"))
    layout = {kind: {format: str(paths[kind, format]) for format in formats} for kind in KINDS}
    script = BLOCKER.format(blocked=blocked) + RUN.format(
        io=str(tmp_path / "io.safetensors"), paths=json.dumps(layout), blocked=blocked
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("ran ") == len(KINDS) * len(formats) + 1
