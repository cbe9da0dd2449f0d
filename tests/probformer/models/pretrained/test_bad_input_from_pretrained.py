"""``from_pretrained``'s options are checked before the folder is read: a map_location
that names no device of this machine failed in the model's ``.to`` with torch's own words
("Expected one of cpu, cuda, ...", "Cannot access accelerator device"), and a
``local_files_only`` given as text was read as true."""

from __future__ import annotations

import pytest
import torch

import probformer


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    config = probformer.TransformerConfig(vocab_size=11, width=8, heads=2, layers=1, ffn_width=16, max_length=8)
    return probformer.save_pretrained(probformer.Transformer(config), tmp_path_factory.mktemp("saved") / "model")


@pytest.mark.parametrize(
    ("map_location", "error", "words"),
    [
        ("bogus", ValueError, r"map_location must be None \(the CPU\), a device name \('cpu', 'cuda', 'cuda:1'\)"),
        ("cpu:x", ValueError, "map_location must be None"),
        (True, TypeError, "map_location must be None .* got bool True"),
        (2.5, TypeError, "map_location must be None .* got float 2.5"),
        ("cuda:99", ValueError, "map_location 'cuda:99': this machine has"),
        # a CUDA device number, as torch.device(99) reads it: none such here (or no accelerator at all)
        (99, ValueError, "map_location (99: this machine has|must be None)"),
    ],
)
def test_a_map_location_this_machine_has_not_is_refused_by_name(folder, map_location, error, words):
    with pytest.raises(error, match=words):
        probformer.from_pretrained(folder, map_location=map_location)
    with pytest.raises(error, match=words):
        probformer.Transformer.from_pretrained(folder, map_location=map_location)


@pytest.mark.parametrize("value", ["x", "false", 1, None])
def test_local_files_only_that_is_not_a_bool_is_refused_by_name(folder, value):
    with pytest.raises(TypeError, match="local_files_only must be True or False"):
        probformer.from_pretrained(folder, local_files_only=value)


@pytest.mark.parametrize("map_location", ["cpu", torch.device("cpu"), None])  # None: where it was read, as torch.load
def test_a_device_of_this_machine_loads(folder, map_location):
    model = probformer.from_pretrained(folder, map_location=map_location)
    assert next(model.parameters()).device == torch.device("cpu")
