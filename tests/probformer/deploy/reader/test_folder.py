"""The torch folder holds JSON and safetensors, nothing else: symlinks, code, pickles and
unknown files are refused, the weights must be safetensors matching the config (no missing,
unknown, mis-shaped, mis-typed or NaN tensor), the config is read strictly (a config
describing more weights than the file holds is refused before the model is allocated) and
the vocabulary must fit the model."""

import json
import pickle

import pytest
import torch
from safetensors.torch import save_file

from probformer.deploy import reader
from tests.probformer.deploy.reader.artefacts import TRANSFORMER, VOCAB, assert_refused, unique_state, write_folder
from tests.probformer.deploy.reader.crafting import Payload


def test_folder_refuses_symlinks_code_and_unknown_files(tmp_path, artefacts):
    folder = write_folder(tmp_path / "f")
    for name, content in [
        ("model.py", b"import os"),
        ("weights.pkl", pickle.dumps(1)),
        ("model.pt", b"x"),
        (".x", b""),
    ]:
        (folder / name).write_bytes(content)
        assert_refused(folder, f"unexpected {name!r}")
        (folder / name).unlink()
    (folder / "sub").mkdir()
    assert_refused(folder, "unexpected 'sub'")
    (folder / "sub").rmdir()
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to(artefacts["folder"] / "config.json")
    assert_refused(folder, "symlink")
    (folder / "config.json").unlink()
    assert_refused(folder, "config.json is missing", error=FileNotFoundError)


def test_folder_weights_must_be_safetensors_matching_the_config(tmp_path, model):
    folder = write_folder(tmp_path / "f", model=model)
    weights = unique_state(model)
    name = "embedding.weight"
    cases = {
        "pickle": None,
        "missing": {k: v for k, v in weights.items() if k != name},
        "unknown": {**weights, "evil": torch.zeros(1)},
        "shape": {**weights, name: torch.zeros(3, 3)},
        "dtype": {**weights, name: weights[name].long()},
        "two float dtypes": {**weights, name: weights[name].double()},
        "nan": {**weights, name: weights[name].clone().fill_(float("nan"))},
    }
    fragments = {"pickle": "not a readable safetensors", "missing": "missing", "unknown": "does not have"}
    fragments.update({"shape": "shape", "dtype": "dtype", "two float dtypes": "several dtypes", "nan": "NaN"})
    marker = tmp_path / "marker"
    for case, state in cases.items():
        if state is None:
            torch.save({name: Payload(marker), "pad": torch.zeros(4000)}, folder / "model.safetensors")
        else:
            save_file(state, str(folder / "model.safetensors"))
        assert_refused(folder, fragments[case])
    assert not marker.exists()


@pytest.mark.parametrize(
    "meta, fragment",
    [
        ({"format": "probformer-torch/1", "model": "transformer"}, "must have keys"),
        ({"format": "probformer-torch/9", "model": "transformer", "config": {}}, "format must be"),
        ({"format": reader.TORCH_FORMAT, "model": "os.system", "config": {}}, "unknown model kind"),
        ({"format": reader.TORCH_FORMAT, "model": "transformer", "config": []}, "JSON object"),
        ({"format": reader.TORCH_FORMAT, "model": "transformer", "config": {**TRANSFORMER, "evil": 1}}, "bad model"),
        ({"format": reader.TORCH_FORMAT, "model": "transformer", "config": {**TRANSFORMER, "width": "16"}}, "bad"),
        ({"format": reader.TORCH_FORMAT, "model": "transformer", "config": {**TRANSFORMER, "vocab_size": 10**12}}, ""),
        ([1, 2], "must have keys"),
    ],
)
def test_folder_config_is_read_strictly(tmp_path, meta, fragment):
    """A config describing more weights than the file holds (vocab_size=10**12) is refused
    before the model is allocated."""
    folder = write_folder(tmp_path / "f")
    (folder / "config.json").write_text(json.dumps(meta))
    assert_refused(folder, fragment)


def test_folder_vocabulary_must_fit_the_model(tmp_path):
    folder = write_folder(tmp_path / "f")
    (folder / "vocabulary.json").write_text(json.dumps(["w"] * VOCAB))
    assert reader.load(folder) is not None
    (folder / "vocabulary.json").write_text(json.dumps(["w"] * 3))
    assert_refused(folder, "vocab_size")
    (folder / "vocabulary.json").write_text('{"a": 1}')
    assert_refused(folder, "list of strings")
