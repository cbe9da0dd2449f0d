"""``train --set`` is the file: the same values given with ``--set`` give the config the
edited file gives (aliases included), typed like the file; overrides are parsed as TOML
values or bare words, and malformed ones are refused."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from probformer.training import run_config
from tests.probformer.cli.commands import probformer, tiny_config

# ---- --set is the file -------------------------------------------------------------------------


def test_set_gives_the_config_of_the_same_values_in_the_file(tmp_path):
    edits = {
        "lr = 3e-3": "lr = 3e-4",
        "rank = 4": "rank = 8",
        "threads = 1": 'threads = 1\nbf16 = true\nschedule = "cosine"',
    }
    edited = tiny_config(tmp_path, name="edited.toml", **edits)
    base = tiny_config(tmp_path, name="base.toml")
    overrides = ["train.lr=3e-4", "model.rank=8", "train.bf16=true", 'train.schedule="cosine"']
    result = probformer("train", "--config", base, *[f"--set={o}" for o in overrides], "--print-config", cwd=tmp_path)
    assert result.returncode == 0 and result.stderr == "", result.stderr  # no warnings either
    assert json.loads(result.stdout) == run_config.load(edited).to_dict()
    train = json.loads(result.stdout)["train"]
    assert train["lr"] == 0.0003 and train["bf16"] is True and train["schedule"] == "cosine"
    assert set(tmp_path.iterdir()) == {edited, base}  # nothing written


def test_set_of_an_alias_replaces_the_files_canonical_key_and_back(tmp_path):
    """--set model.head_dim=8 on a file that says rank = 4 is rank = 8, as the alias table says
    (docs/models.md), not 'the same setting given twice'; and the other way round."""
    base = tiny_config(tmp_path, name="base.toml")
    edited = tiny_config(tmp_path, name="edited.toml", **{"rank = 4": "rank = 8"})
    assert run_config.load(base, ["model.head_dim=8"]) == run_config.load(edited)
    aliased = tiny_config(tmp_path, name="aliased.toml", **{"rank = 4": "head_dim = 4"})
    assert run_config.load(aliased, ["model.rank=8"]) == run_config.load(edited)


@settings(max_examples=30)
@given(
    lr=st.floats(1e-6, 10.0, allow_nan=False),
    rank=st.integers(1, 16),
    topology=st.sampled_from(["full", "window(2)", "window(2) | star()", "full | root()"]),
)
def test_set_values_are_typed_like_the_file(tmp_path_factory, lr, rank, topology):
    folder = tmp_path_factory.mktemp("set")
    base = tiny_config(folder, name="base.toml")
    edited = tiny_config(
        folder,
        name="edited.toml",
        **{"lr = 3e-3": f"lr = {lr!r}", "rank = 4": f'rank = {rank}\ntopology = "{topology}"'},
    )
    bare = [f"train.lr={lr!r}", f"model.rank={rank}", f"model.topology={topology}"]  # a bare word: a string
    quoted = bare[:2] + [f'model.topology="{topology}"']
    expected = run_config.load(edited)
    assert run_config.load(base, bare) == expected
    assert run_config.load(base, quoted) == expected


@pytest.mark.parametrize(
    "assignment, path, value",
    [
        ("train.lr=3e-4", ["train", "lr"], 0.0003),
        ("model.rank = 32", ["model", "rank"], 32),
        ("train.bf16=false", ["train", "bf16"], False),
        ('data.source="ptb"', ["data", "source"], "ptb"),
        ("data.source=corpus/wiki.txt", ["data", "source"], "corpus/wiki.txt"),
        ("model.weights=[1, 2]", ["model", "weights"], [1, 2]),
        ("model.topology=window(3) | star()", ["model", "topology"], "window(3) | star()"),
    ],
)
def test_override_parsing(assignment, path, value):
    assert run_config.parse_override(assignment) == (path, value)


@pytest.mark.parametrize("assignment", ["train.lr", "=3", "train..lr=1", 'data.source="ptb', "model.rank="])
def test_malformed_overrides_are_refused(assignment):
    with pytest.raises(ValueError, match="--set"):
        run_config.parse_override(assignment)
