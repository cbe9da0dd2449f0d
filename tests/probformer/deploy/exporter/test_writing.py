"""What export writes, and where: bad requests are refused with nothing written, an export
that differs from its source is not written, an earlier export is replaced but nothing
else is (not a user's file or folder, a training checkpoint or a run's model), and a path
inside a model folder is refused before anything is written."""

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import graphs
import probformer
from probformer import cli
from probformer.training import data
from tests.probformer.deploy.exporter.tiny_models import VOCAB, assert_reproduces, pt, transformer


def test_bad_export_requests_are_refused(tmp_path):
    with pytest.raises(ValueError, match="format must be one of"):
        probformer.export(pt(), tmp_path / "x", format="tflite")
    with pytest.raises(ValueError, match="not a probformer model: Linear"):
        probformer.export(torch.nn.Linear(2, 2), tmp_path / "x")
    for format in ("exported", "onnx"):  # values decide the number of iterations: no fixed graph
        with pytest.raises(ValueError, match="halting='act' or 'exit'.*format='torch'"):
            probformer.export(pt(halting="exit"), tmp_path / "x", format=format)
        with pytest.raises(ValueError, match="schedule='sequential'"):
            probformer.export(pt(schedule="sequential"), tmp_path / "x", format=format)
    with pytest.raises(ValueError, match="span=True"):
        probformer.export(pt(span=True), tmp_path / "x", format="onnx")
    model = pt()
    model.crf.topology = graphs.topology.Topology("custom", (), lambda n: torch.ones(n, n, dtype=torch.bool))
    with pytest.raises(ValueError, match="topology 'custom' is not the config's"):
        probformer.export(model, tmp_path / "x")
    with pytest.raises(ValueError, match="token ids must lie in"):
        probformer.export(pt(), tmp_path / "x", example=torch.tensor([[VOCAB]]))
    with pytest.raises(ValueError, match="max_length must be an integer"):
        probformer.export(pt(), tmp_path / "x", max_length=0)
    with pytest.raises(TypeError, match="max_length must be an integer"):
        probformer.export(pt(), tmp_path / "x", max_length=2.0)
    for tolerance in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="tolerance must be a finite number >= 0"):
            probformer.export(pt(), tmp_path / "x", tolerance=tolerance)
    for tolerance in ("0.1", True):
        with pytest.raises(TypeError, match="tolerance must be a finite number >= 0"):
            probformer.export(pt(), tmp_path / "x", tolerance=tolerance)
    assert list(tmp_path.iterdir()) == []  # nothing written, nothing half-written


def test_an_export_that_differs_from_its_source_is_not_written(tmp_path, monkeypatch):
    from probformer.deploy import exporter

    model = transformer()
    wrong = lambda path: lambda tokens, mask: model(tokens, mask)[0] + 1e-3  # noqa: E731
    monkeypatch.setattr(exporter, "load", wrong)
    with pytest.raises(RuntimeError, match="differs from the source model by 0.001"):
        probformer.export(model, tmp_path / "x")
    assert list(tmp_path.iterdir()) == []


def test_export_replaces_an_earlier_export_and_nothing_else(tmp_path):
    model = transformer()
    for name, format in (("model", "torch"), ("model.pt2", "exported")):
        path = probformer.export(model, tmp_path / name, format)
        assert probformer.export(model, path, format) == path  # an earlier export is replaced
    notes, folder = tmp_path / "notes.onnx", tmp_path / "mine"
    notes.write_text("my notes")
    folder.mkdir()
    (folder / "data.txt").write_text("keep")
    for target, format in ((notes, "onnx"), (folder, "torch"), (folder, "exported")):
        with pytest.raises(FileExistsError, match="is not a probformer export"):
            probformer.export(model, target, format)
    assert notes.read_text() == "my notes" and (folder / "data.txt").read_text() == "keep"


def test_export_never_replaces_a_training_checkpoint_or_a_runs_model(tmp_path, capsys):
    """A checkpoint and a run's model/ are the export's folder format with more in them (the
    training state, the tags), or with the same file names: export refuses both and leaves
    every byte as it was."""
    from probformer.training import run_checkpoints

    model = transformer()
    vocabulary = data.Vocabulary.build([[f"w{i}" for i in range(VOCAB - 3)]])
    run = tmp_path / "run"
    optimizer = torch.optim.AdamW(model.parameters())
    step = run_checkpoints.save_training_checkpoint(run, 2, model, optimizer, vocabulary, {"step": 2})
    run_checkpoints.save_model_folder(run, model, vocabulary, ["NOUN", "VERB"])
    plain = run_checkpoints.save_model_folder(tmp_path / "plain", model, vocabulary, None)  # the export's file names
    before = {p: p.read_bytes() for folder in (step, run / "model", plain) for p in folder.iterdir()}
    for target in (step, run / "model", plain):
        with pytest.raises(FileExistsError, match="is not a probformer export"):
            probformer.export(model, target)
        assert cli.main(["export", str(run), "--out", str(target)]) == 2
        assert "is not a probformer export" in capsys.readouterr().err
    assert {p: p.read_bytes() for folder in (step, run / "model", plain) for p in folder.iterdir()} == before


@settings(max_examples=30, deadline=None)
@given(
    extras=st.sets(
        st.sampled_from(["training.json", "training.safetensors", "tags.json", "notes.txt", "loader.py", ".hidden"])
    ),
    header=st.booleans(),
)
def test_only_a_folder_holding_what_export_wrote_is_replaced(tmp_path_factory, extras, header):
    """Oracle: replaceable exactly when the folder holds an export's files and nothing else,
    its weights' header naming the format as export writes it."""
    from safetensors.torch import load_file

    from probformer.deploy import exporter

    folder = probformer.export(transformer(), tmp_path_factory.mktemp("e") / "model", vocabulary=None)
    if not header:  # rewritten as a training run writes its weights
        save_file(load_file(str(folder / "model.safetensors")), str(folder / "model.safetensors"))
    for name in extras:
        (folder / name).write_text("{}")
    if extras <= {"tags.json"} and header:  # a tagger's export holds its tags.json
        exporter._check_replaceable(folder)
    else:
        with pytest.raises(FileExistsError, match="is not a probformer export"):
            exporter._check_replaceable(folder)


@pytest.fixture(scope="module")
def model_folders(tmp_path_factory):
    """A run's model/, a training checkpoint and a torch export of one model."""
    from probformer.training import run_checkpoints

    root, model = tmp_path_factory.mktemp("folders"), transformer()
    optimizer = torch.optim.AdamW(model.parameters())
    step = run_checkpoints.save_training_checkpoint(root / "run", 2, model, optimizer, None, {"step": 2})
    run_checkpoints.save_model_folder(root / "run", model, None, None)
    return model, [root / "run" / "model", step, probformer.export(model, root / "export")]


@settings(max_examples=40, deadline=None)
@given(
    which=st.integers(0, 2),
    below=st.lists(st.sampled_from(["sub", "deeper", "model"]), max_size=2),
    name=st.sampled_from(["model.onnx", "model.pt2", "model", "config.json"]),
)
def test_export_refuses_a_path_inside_a_model_folder(model_folders, which, below, name):
    """Oracle: the folder's bytes are unchanged and it still loads as the same model."""
    model, folders = model_folders
    folder = folders[which]
    before = {p: p.read_bytes() for p in folder.iterdir()}
    format = {".onnx": "onnx", ".pt2": "exported"}.get(Path(name).suffix, "torch")
    with pytest.raises(ValueError, match=f"lies inside the model folder {folder}"):
        probformer.export(model, folder.joinpath(*below, name), format)
    assert {p: p.read_bytes() for p in folder.iterdir()} == before
    assert_reproduces(model, probformer.load(folder))


def test_export_beside_a_model_folder_is_written(model_folders):
    model, folders = model_folders
    assert_reproduces(model, probformer.load(probformer.export(model, folders[0].parent / "beside.pt2", "exported")))
