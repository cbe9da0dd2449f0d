"""``data.source = "hf:..."``: Hugging Face ``datasets`` read offline, from a folder written
by ``save_to_disk`` or the packaged ``text`` builder on local files."""

import json
import math
import re
import sys

import pytest

from probformer.training import data, hf_data
from probformer.training.evaluate import read_split
from probformer.training.trainer import train

datasets = pytest.importorskip("datasets")  # the optional extra probformer[hf]


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """No network, and the builder's cache in the test's folder (datasets reads its
    environment at import, so its config is set too)."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")


TRAIN = ["  the cat sat  ", "", "a dog ran", "the end"]


VALIDATION = ["one more line"]


TEST = ["held for testing", "   "]


def test_a_saved_dataset_dict_gives_its_own_splits(tmp_path):
    saved = tmp_path / "saved"
    splits = {"train": TRAIN, "validation": VALIDATION, "test": TEST}
    datasets.DatasetDict({k: datasets.Dataset.from_dict({"text": v}) for k, v in splits.items()}).save_to_disk(saved)
    expected = {
        "train": ["the cat sat", "a dog ran", "the end"],
        "valid": ["one more line"],
        "test": ["held for testing"],
    }
    assert data.text_splits(f"hf:{saved}") == expected  # stripped, empty lines left out
    assert data.text_lines(f"hf:{saved}") == expected["train"] + expected["valid"] + expected["test"]
    for split in ("train", "valid", "test"):  # evaluate --split reads the same splits as training
        assert read_split(f"hf:{saved}", split) == ([line.split() for line in expected[split]], split)


@pytest.mark.parametrize("other", ["val", "extra"])
def test_a_split_read_nowhere_is_refused_naming_the_split_names(tmp_path, other):
    """A 'val' split was not taken for validation (a twentieth of train was held out instead)."""
    saved = tmp_path / "saved"
    splits = {"train": TRAIN, other: VALIDATION}
    datasets.DatasetDict({k: datasets.Dataset.from_dict({"text": v}) for k, v in splits.items()}).save_to_disk(saved)
    with pytest.raises(ValueError, match=rf"has splits \['{other}'\] that are none of 'train', 'test' or .*'dev'"):
        data.text_splits(f"hf:{saved}")


@pytest.mark.parametrize(
    "names", [["dev", "validation"], ["valid", "validation"], ["dev", "valid"], ["dev", "valid", "validation"]]
)
def test_two_validation_splits_are_refused_naming_them(tmp_path, names):
    """Each of the validation names alone validates; with two, one was read and the other
    silently left out."""
    saved = tmp_path / "saved"
    splits = {"train": TRAIN} | {name: [f"{name} line"] for name in names}
    datasets.DatasetDict({k: datasets.Dataset.from_dict({"text": v}) for k, v in splits.items()}).save_to_disk(saved)
    with pytest.raises(ValueError, match=re.escape(f"has validation splits {names}:") + ".*keep one of them"):
        data.text_splits(f"hf:{saved}")


@pytest.mark.parametrize("name", ["validation", "valid", "dev"])
def test_each_validation_name_alone_validates(tmp_path, name):
    saved = tmp_path / "saved"
    splits = {"train": TRAIN, name: VALIDATION}
    datasets.DatasetDict({k: datasets.Dataset.from_dict({"text": v}) for k, v in splits.items()}).save_to_disk(saved)
    assert data.text_splits(f"hf:{saved}")["valid"] == VALIDATION


def test_a_single_dataset_holds_out_its_last_twentieth_and_finds_its_text_column(tmp_path):
    lines = [f"sentence number {i}" for i in range(41)]
    saved = tmp_path / "single"
    datasets.Dataset.from_dict({"id": list(range(41)), "sentence": lines}).save_to_disk(saved)
    splits = data.text_splits(f"hf:{saved}")
    assert splits == {"train": lines[:39], "valid": lines[39:]}  # 41 // 20 = 2 lines validate


def test_the_text_builder_on_local_files(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("first line\n\nsecond line\n")
    (folder / "b.txt").write_text("third line\n")
    (folder / "skip.md").write_text("not text\n")
    lines = data.text_lines(f"hf:text:{folder}/*.txt")
    assert sorted(lines) == ["first line", "second line", "third line"]
    with pytest.raises(ValueError, match="needs at least 2 lines"):
        data.text_splits(f"hf:text:{folder / 'b.txt'}")


def test_a_text_file_gives_the_lines_the_text_builder_gives(tmp_path):
    """Oracle: datasets' own text builder (universal newlines, then "\\n" only): a text file
    read directly is cut at the same places, whatever Unicode separators its lines hold."""
    path = tmp_path / "seps.txt"
    path.write_bytes("the cat sat\u2028on the mat\r\nan\x85b\rform\x0cfeed line\n\x0b\nlast\u2029".encode())
    assert data.text_lines(path) == data.text_lines(f"hf:text:{path}")
    assert len(data.text_lines(path)) == 4


@pytest.mark.parametrize(
    "source,error,message",
    [
        ("hf:", ValueError, "write hf:DIR or hf:BUILDER:FILES"),
        ("hf:wikitext:wikitext-2-raw-v1", ValueError, r"unknown builder 'wikitext'; allowed: \['text', 'json'"),
        ("hf:text:{tmp}/none/*.txt", FileNotFoundError, "no file matches"),
        ("hf:{tmp}/missing", FileNotFoundError, "is not a folder written by save_to_disk"),
        ("hf:{tmp}", ValueError, "is not a saved dataset"),
        ("hf:{tmp}/two", ValueError, "no 'text' column and not exactly one string column"),
        ("hf:{tmp}/numbers", ValueError, "no 'text' column"),
        ("hf:{tmp}/no-train", ValueError, r"has no 'train' split; it has \['validation'\]"),
    ],
)
def test_bad_sources_are_clear_errors(tmp_path, source, error, message):
    datasets.Dataset.from_dict({"a": ["x"], "b": ["y"]}).save_to_disk(tmp_path / "two")
    datasets.Dataset.from_dict({"n": [1, 2]}).save_to_disk(tmp_path / "numbers")
    datasets.DatasetDict({"validation": datasets.Dataset.from_dict({"text": ["v"]})}).save_to_disk(
        tmp_path / "no-train"
    )
    with pytest.raises(error, match=message):
        data.text_splits(source.format(tmp=tmp_path))


def test_without_the_datasets_package_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'probformer\[hf\]'"):
        hf_data.hf_splits("hf:anything")


CONFIG = """
[model]
kind = "probabilistic_transformer"
labels = 16
channels = 2
rank = 4
iterations = 2

[data]
source = "hf:{saved}"
max_length = 6
long_sentences = "windows"
vocabulary = 120

[train]
batch_size = 8
steps = 2
warmup_steps = 1
threads = 1
"""


def test_a_model_trains_on_a_saved_dataset_with_long_lines_windowed(tmp_path):
    words = "the cat sat on a mat while dogs ran past houses near rivers".split()
    lines = [" ".join(words[i % 5 : i % 5 + 3 + i % 9]) for i in range(60)]
    valid = ["the cat sat on a mat while dogs ran", "dogs ran past houses", "a cat sat near rivers"]
    saved = tmp_path / "saved"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": lines}),
            "validation": datasets.Dataset.from_dict({"text": valid}),
        }
    ).save_to_disk(saved)
    (tmp_path / "run.toml").write_text(CONFIG.format(saved=saved))
    summary = train(tmp_path / "run.toml", tmp_path / "run", progress=False)
    assert summary["steps"] == 2 and math.isfinite(summary["valid"]["loss"])
    # the one validation line has 9 words (>= 9 pieces) at max_length 6: cut, counted, reported
    assert summary["windowed_sentences"]["validation"] == 1
    assert summary["windowed_sentences"]["training"] >= sum(len(line.split()) > 6 for line in lines)
    assert (tmp_path / "run" / "model" / "tokenizer.json").is_file()
    assert json.loads((tmp_path / "run" / "run.json").read_text())["data_sha256"]  # the text is fingerprinted
