"""Files that are not what they claim are refused with a clear error naming them: damaged
torch folders, truncated ``.pt2`` and ONNX files, noise, a missing path, an ONNX file that
probformer did not export; and the loaded models check their inputs."""

import json
from pathlib import Path

import pytest
import torch

import probformer
from tests.probformer.deploy.exporter.tiny_models import FILES, VOCAB

# ---- files that are not what they claim -------------------------------------------------
# (crafted archives and code-execution attempts: tests/probformer/deploy/reader/)


@pytest.fixture(scope="module")
def exported(every_export):
    _, paths = every_export
    return {format: paths["particle_transformer", format] for format in FILES}


def copy(source: Path, target: Path) -> Path:
    if source.is_dir():
        target.mkdir()
        for file in source.iterdir():
            (target / file.name).write_bytes(file.read_bytes())
    else:
        target.write_bytes(source.read_bytes())
    return target


def edit_config(folder: Path, edit) -> None:
    meta = json.loads((folder / "config.json").read_text())
    edit(meta)
    (folder / "config.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:100]), "safetensors"),
        (lambda f: (f / "model.safetensors").unlink(), "model.safetensors is missing"),
        (lambda f: (f / "config.json").write_text("{not json"), "not valid JSON"),
        (lambda f: edit_config(f, lambda m: m.update(format="probformer-torch/1")), "format must be"),
        (lambda f: edit_config(f, lambda m: m.update(model="gpt")), "unknown model"),
        (lambda f: edit_config(f, lambda m: m["config"].update(width=32, heads=2)), "shape|bytes"),
        (lambda f: edit_config(f, lambda m: m["config"].update(layers=4)), "missing|lacks"),
        (lambda f: edit_config(f, lambda m: m["config"].update(task="translation")), "task"),
        (lambda f: (f / "probformer_runtime.py").write_text("print('hello')"), "unexpected"),
    ],
)
def test_damaged_torch_exports_are_refused(exported, tmp_path, damage, message):
    folder = copy(exported["torch"], tmp_path / "damaged")
    damage(folder)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        probformer.load(folder)


def test_damaged_and_foreign_files_are_refused(exported, tmp_path):
    truncated = tmp_path / "truncated.pt2"
    truncated.write_bytes(exported["exported"].read_bytes()[:-4000])
    with pytest.raises(ValueError, match="truncated.pt2"):
        probformer.load(truncated)
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(exported["onnx"].read_bytes()[:-3000])
    with pytest.raises(ValueError, match="broken.onnx"):
        probformer.load(broken)
    noise = tmp_path / "noise.bin"
    noise.write_bytes(bytes(range(256)) * 10)
    with pytest.raises(ValueError, match="noise.bin"):
        probformer.load(noise)
    with pytest.raises(FileNotFoundError, match="no exported model"):
        probformer.load(tmp_path / "nothing.onnx")


def test_foreign_onnx_is_refused(tmp_path):
    import onnx

    plain = tmp_path / "plain.onnx"
    torch.onnx.export(torch.nn.Linear(2, 2).eval(), (torch.ones(1, 2),), str(plain), dynamo=True, external_data=False)
    onnx.checker.check_model(onnx.load(str(plain)))
    with pytest.raises(ValueError, match="not a probformer export"):
        probformer.load(plain)


def test_loaded_models_check_their_inputs(exported):
    for path in exported.values():
        model = probformer.load(path)
        with pytest.raises(ValueError, match="token ids must lie in"):
            model(torch.tensor([[VOCAB]]))
        with pytest.raises(ValueError, match="at least one real token"):
            model(torch.tensor([[1, 2]]), torch.tensor([[False, False]]))
        with pytest.raises(ValueError, match="exceeds max_length"):
            model(torch.zeros(1, 21, dtype=torch.long))
