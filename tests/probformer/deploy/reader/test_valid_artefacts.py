"""Valid artefacts load and compute the source model's logits: the torch folder and the
``.pt2`` exactly, ONNX within 1e-5; a folder stores each shared tensor once (twice is
refused) and a bf16 folder loads in bf16."""

import pytest
import torch
from safetensors.torch import save_file

from probformer.deploy import reader
from tests.probformer.deploy.reader.artefacts import (
    PT,
    assert_refused,
    batch,
    expected_logits,
    tiny,
    unique_state,
    write_folder,
)


@pytest.mark.parametrize("fmt, tolerance", [("folder", 0.0), ("pt2", 0.0), ("onnx", 1e-5)])
def test_valid_artefacts_reproduce_the_source_model(artefacts, model, fmt, tolerance):
    loaded = reader.load(artefacts[fmt])
    tokens, mask = batch()
    with torch.no_grad():
        found = loaded(tokens, mask)
    assert (found - expected_logits(model, tokens, mask)).abs().max().item() <= tolerance


def test_folder_with_shared_tensors_loads_each_once(tmp_path):
    pt = tiny("probabilistic_transformer", PT)
    assert len(unique_state(pt)) < len(pt.state_dict())  # the PT's crf is also mean_field.crf
    folder = write_folder(tmp_path / "pt", "probabilistic_transformer", pt)
    tokens, mask = batch()
    with torch.no_grad():
        assert torch.equal(reader.load(folder)(tokens, mask), expected_logits(pt, tokens, mask))
    weights = {**unique_state(pt), "mean_field.crf.unary": pt.crf.unary.detach().clone()}  # stored twice
    save_file(weights, str(folder / "model.safetensors"))
    assert_refused(folder, "stored 2 times")


def test_bf16_folder_loads_in_bf16(tmp_path, model):
    half = tiny().to(torch.bfloat16)
    folder = write_folder(tmp_path / "bf16", model=half)
    loaded = reader.load(folder)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    tokens, mask = batch()
    with torch.no_grad():
        assert torch.equal(loaded(tokens, mask), expected_logits(half, tokens, mask))
