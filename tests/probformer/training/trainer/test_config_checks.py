"""Bad input is caught before anything is written: a bad config key or value, empty and
malformed data files, absurd sizes and non-finite values (refused naming the key and the
limit), an unknown model kind, a model too large for the data's vocabulary, and the CLI's
check of the whole config before it creates the run folder."""

import math
import re
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from probformer.training import run_config
from probformer.training.trainer import train
from tests.builders import TINY_PT_RUN as TINY
from tests.probformer.training.trainer.cli_process import cli


@pytest.mark.parametrize(
    "mutate,error",
    [
        (lambda t: t.replace('kind = "probabilistic_transformer"', 'kind = "lstm"'), "model.kind"),
        (lambda t: t.replace("labels = 16", 'labels = "16"'), "model.labels"),
        (lambda t: t.replace("batch_size = 8", "batch_size = 8\nbatch = 3"), "train.batch"),
        (lambda t: t.replace("lr = 3e-3", "lr = -1.0"), "train.lr"),
        (lambda t: t.replace("lr = 3e-3", "lr = true"), "train.lr"),
        (lambda t: t.replace("max_length = 90", "max_length = 5"), "longer than data.max_length"),
        (lambda t: t.replace('source = "ptb"', 'source = "/no/such/file.txt"'), "does not exist"),
        (lambda t: t.replace('task = "mlm"', 'task = "pos"'), "data.source"),
        (lambda t: t.replace("[data]", "[data]\nvocab_size = 3"), "data.vocab_size"),
        (lambda t: t.replace("iterations = 2", "iterations = 2\nvocab_size = 9"), "set from the data"),
        (lambda t: t + "\n[extra]\n", "unknown config tables"),
        (lambda t: t.replace("[model]", "[model"), "not valid TOML"),
    ],
)
def test_bad_input_is_caught_before_anything_is_written(tmp_path, mutate, error):
    config = tmp_path / "bad.toml"
    config.write_text(mutate(TINY.format(dropout=0.1, source="ptb", task="mlm", max_length=90, steps=2)))
    out = tmp_path / "out"
    with pytest.raises((ValueError, TypeError, FileNotFoundError), match=error):
        train(config, out, progress=False)
    assert not out.exists()


def test_empty_and_malformed_data_files(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    text = TINY.format(dropout=0.1, source=empty, task="mlm", max_length=90, steps=2)
    (tmp_path / "c.toml").write_text(text)
    with pytest.raises(ValueError, match="no text"):
        train(tmp_path / "c.toml", tmp_path / "out", progress=False)
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    (tmp_path / "c.toml").write_text(text.replace(str(empty), str(binary)))
    with pytest.raises(ValueError, match="not UTF-8"):
        train(tmp_path / "c.toml", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


# ---- sizes and values refused by the run config, before any folder -------------------------


NOT_FINITE = "must be a finite number with |value| <= 1e+06 (the limit)"  # ConfigMixin's check, first


@pytest.mark.parametrize(
    "table,key,value,limit",
    [
        ("train", "lr", math.inf, NOT_FINITE),
        ("train", "lr", math.nan, NOT_FINITE),
        ("train", "lr", -1e-3, "must be a finite number in (0, 10]"),
        ("train", "lr", 0, "must be a finite number in (0, 10]"),
        ("train", "lr", 100.0, "must be a finite number in (0, 10]"),
        ("train", "weight_decay", math.nan, NOT_FINITE),
        ("train", "clip", math.inf, NOT_FINITE),
        ("train", "batch_size", 10**5, "must be an integer in [1, 65,536]"),
        ("train", "batch_size", 0, "must be an integer in [1, 65,536]"),
        ("train", "steps", 10**12, "must be an integer in [0, 100,000,000]"),
        ("train", "epochs", 10**6, "must be an integer in [1, 100,000]"),
        ("train", "threads", 2_000, "must be an integer in [0, 1,024]"),
        ("train", "seed", 2**40, "must be an integer in [0, 4,294,967,295]"),
        ("train", "seed", -1, "must be an integer in [0, 4,294,967,295]"),
        ("train", "log_every", 0, "must be an integer in [1, 100,000,000]"),
        ("data", "max_length", 10**5, "must be an integer in [1, 16,384]"),
        ("data", "vocabulary", 2 * 10**6, "must be an integer in [4, 1,000,000]"),
        ("data", "mask_rate", math.nan, NOT_FINITE),
        ("data", "mask_rate", 1.5, "must lie in (0, 1)"),
        ("model", "labels", 10**6, "must be <= 65536 (the limit)"),
    ],
)
def test_absurd_values_are_refused_naming_the_key_and_the_limit(table, key, value, limit):
    values = {"model": {"kind": "probabilistic_transformer"}, "data": {}, "train": {}}
    values[table][key] = value
    with pytest.raises(ValueError, match=rf"config key '{table}\.{key}' {re.escape(limit)}, got"):
        run_config.RunConfig.from_dict(values)


@settings(max_examples=50, deadline=None)
@given(
    kind=st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
        lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=4), inner, max_size=2),
        max_leaves=4,
    )
)
def test_model_kind_is_one_of_the_kinds_or_refused_naming_the_key(kind):
    """Oracle: the registry's kind names are the only values; anything else (a list was an
    unhashable-type TypeError) is a ValueError naming 'model.kind'."""
    from probformer.models import registry

    values = {"model": {"kind": kind}, "data": {}, "train": {}}
    if isinstance(kind, str) and kind in registry.KINDS:
        return
    with pytest.raises(ValueError, match=r"config key 'model\.kind' must be one of"):
        run_config.RunConfig.from_dict(values)


def test_a_model_too_large_for_the_data_vocabulary_is_refused_before_allocating():
    # estimated from the config's numbers at the largest vocabulary data.vocabulary allows
    values = {"model": {"kind": "probabilistic_transformer", "labels": 60_000}, "data": {"vocabulary": 10**6}}
    with pytest.raises(ValueError, match=r"parameters, more than the limit 2,147,483,648"):
        run_config.RunConfig.from_dict({**values, "train": {}})


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda t: t.replace("lr = 3e-3", "lr = inf"), f"config key 'train.lr' {NOT_FINITE}, got inf"),
        (lambda t: t.replace("lr = 3e-3", "lr = 50.0"), "config key 'train.lr' must be a finite number in (0, 10]"),
        (
            lambda t: t.replace("labels = 16", "labels = 60000").replace("vocabulary = 400", "vocabulary = 1000000"),
            "more than the limit 2,147,483,648",
        ),
        (lambda t: t.replace("channels = 2", "channels = 0"), "config key 'model.channels'"),
        (
            lambda t: (
                t.replace('kind = "probabilistic_transformer"', 'kind = "transformer"\nmax_length = 16')
                .replace(
                    "labels = 16\nchannels = 2\nrank = 4\niterations = 2",
                    "width = 8\nheads = 2\nlayers = 1\nffn_width = 8",
                )
                .replace("mup = true\n", "")
            ),
            "config key 'model.max_length' (16) is below 'data.max_length' (90)",
        ),
    ],
)
def test_cli_validates_the_whole_config_before_creating_the_run_folder(tmp_path, mutate, message):
    config = tmp_path / "bad.toml"
    config.write_text(mutate(TINY.format(dropout=0.1, source="ptb", task="mlm", max_length=90, steps=2)))
    out = tmp_path / "X"
    process = cli("train", "--config", str(config), "--out", str(out), stderr=subprocess.PIPE)
    _, error = process.communicate(timeout=120)
    assert process.returncode == 2  # a user error (docs/cli.md)
    assert message in error.decode() and "Traceback" not in error.decode()
    assert not out.exists()
