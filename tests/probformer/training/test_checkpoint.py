import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import probformer as pf
from probformer.training import checkpoint, data
from tests.builders import unwritable


def models():
    torch.manual_seed(0)
    yield pf.ProbabilisticTransformer(pf.PTConfig(vocab_size=20, labels=8, channels=2, rank=2, iterations=2))
    yield pf.ParticleTransformer(pf.ParticleConfig(vocab_size=20, width=16, heads=2, layers=2, ffn_width=32))


@pytest.mark.parametrize("model", list(models()), ids=["pt", "particle"])
def test_round_trip_gives_equal_outputs(model, tmp_path):
    vocab = data.Vocabulary(["<pad>", "<unk>", "<mask>"] + [f"w{i}" for i in range(17)])
    checkpoint.save(model, tmp_path, vocab)
    loaded, loaded_vocab = checkpoint.load(tmp_path)
    tokens = torch.randint(0, 20, (2, 7))
    model.eval(), loaded.eval()
    torch.testing.assert_close(loaded(tokens)[0], model(tokens)[0])
    assert loaded_vocab.words == vocab.words
    assert not list(tmp_path.glob(".*tmp*"))  # no temporary files left behind


def test_corrupt_and_foreign_files_are_refused(tmp_path):
    model = next(models())
    checkpoint.save(model, tmp_path)
    weights = tmp_path / "model.safetensors"
    content = weights.read_bytes()
    weights.write_bytes(content[: len(content) // 2])
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        checkpoint.load(tmp_path)
    weights.write_bytes(content)
    meta = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**meta, "format": "other"}))
    with pytest.raises(ValueError, match="format must be"):
        checkpoint.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**meta, "config": {**meta["config"], "labels": 9}}))
    with pytest.raises(ValueError, match="shape mismatch"):
        checkpoint.load(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        checkpoint.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        checkpoint.load(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="cannot checkpoint a Linear"):
        checkpoint.save(torch.nn.Linear(2, 2), tmp_path / "x")


# ---- non-finite weights and failed writes ----------------------------------------------


SMALL = {
    "probabilistic_transformer": {"vocab_size": 20, "labels": 8, "channels": 2, "rank": 2, "iterations": 2},
    "particle_transformer": {"vocab_size": 20, "width": 16, "heads": 2, "layers": 2, "ffn_width": 32},
    "transformer": {"vocab_size": 20, "width": 16, "heads": 2, "layers": 2, "ffn_width": 32},
    "swarmformer": {"vocab_size": 20, "width": 16, "heads": 2, "layers": 2, "ffn_width": 32, "clusters": 4},
    "folded_context": {"vocab_size": 20, "width": 16, "heads": 2, "ffn_width": 32, "segment": 4},
}


def test_every_model_kind_is_in_the_table():
    from probformer.models import registry

    assert sorted(SMALL) == sorted(registry.KINDS)


@pytest.mark.parametrize("kind", sorted(SMALL))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_load_refuses_non_finite_weights_naming_the_tensor(tmp_path, kind, bad):
    from probformer.models import registry

    torch.manual_seed(0)
    model = registry.build(kind, SMALL[kind])
    name, tensor = next((n, t) for n, t in registry.unique_state(model).items() if t.is_floating_point())
    checkpoint.save(model, tmp_path)
    assert isinstance(checkpoint.load(tmp_path)[0], type(model))  # finite: loads
    with torch.no_grad():
        tensor.view(-1)[-1] = bad
    checkpoint.save(model, tmp_path)
    with pytest.raises(ValueError, match=f"tensor '{name}' holds NaN or infinite values"):
        checkpoint.load(tmp_path)


def test_disk_full_during_save_is_one_error_naming_the_path_and_leaves_nothing(tmp_path, monkeypatch):
    import errno

    model = next(models())

    def full_disk(tensors, path):
        with open(path, "wb") as handle:  # half a file, as a full disk leaves it
            handle.write(b"\0" * 10)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_file", full_disk)
    with pytest.raises(checkpoint.WriteError, match="cannot write .*model.safetensors: No space left on device") as e:
        checkpoint.save(model, tmp_path / "ck")
    assert e.value.errno == errno.ENOSPC and isinstance(e.value, OSError)
    assert e.value.__cause__ is None and e.value.__suppress_context__  # one error, not a chain
    assert list(tmp_path.iterdir()) == []  # no temporary file, and not the folder the save created


def test_save_into_an_unwritable_folder_is_one_error_naming_the_path(tmp_path):
    model = next(models())
    with unwritable(tmp_path / "locked") as locked:
        with pytest.raises(checkpoint.WriteError, match=f"cannot write {locked}"):
            checkpoint.save(model, locked)
        assert list(locked.iterdir()) == []


TAGS = ["ADJ", "NOUN", "VERB"]


@pytest.fixture(scope="module")
def tagger_folder(tmp_path_factory):
    """A tagging model with three classes, as checkpoint.save writes it."""
    from probformer.models import registry

    torch.manual_seed(0)
    config = {"vocab_size": 8, "width": 8, "heads": 2, "layers": 1, "ffn_width": 8, "task": "tagging"}
    model = registry.build("transformer", {**config, "num_classes": len(TAGS)})
    return checkpoint.save(model, tmp_path_factory.mktemp("tagger") / "model")


@settings(max_examples=60, deadline=None)
@given(
    tags=st.one_of(
        st.lists(st.sampled_from([*TAGS, "X", "PUNCT"]), max_size=5),
        st.lists(st.one_of(st.integers(), st.none(), st.text(max_size=3)), max_size=4),
        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
        st.text(max_size=5),
    ),
    where=st.sampled_from(["tags.json", "training.json"]),
)
def test_tags_are_distinct_strings_one_per_class_wherever_they_are_stored(tagger_folder, tmp_path_factory, tags, where):
    """Oracle: accepted exactly when the tags are a list of distinct strings of num_classes
    entries; anything else is a ValueError naming the file (a tagger's tags.json, or the
    'tags' of a checkpoint's training.json)."""
    folder = tmp_path_factory.mktemp("copy")
    for file in tagger_folder.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    record = tags if where == "tags.json" else {"step": 2, "tags": tags}
    (folder / where).write_text(json.dumps(record))
    valid = isinstance(tags, list) and all(isinstance(t, str) for t in tags) and len(set(tags)) == len(tags) == 3
    if valid:
        assert checkpoint.load_tags(folder, len(TAGS)) == tags
    else:
        with pytest.raises(ValueError, match=f"{folder / where}"):
            checkpoint.load_tags(folder, len(TAGS))


def test_a_folder_without_tags_has_none_and_unreadable_tags_name_the_file(tagger_folder, tmp_path):
    assert checkpoint.load_tags(tagger_folder, len(TAGS)) is None
    for file in tagger_folder.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    (tmp_path / "training.json").write_text(json.dumps({"step": 2, "tags": None}))  # an mlm checkpoint's
    assert checkpoint.load_tags(tmp_path, len(TAGS)) is None
    (tmp_path / "tags.json").write_text("not json")
    with pytest.raises(ValueError, match=f"{tmp_path / 'tags.json'} is not valid JSON"):
        checkpoint.load_tags(tmp_path, len(TAGS))
