"""The ``probformer`` command line as a user runs it (a subprocess): --version, one-line
user errors with exit status 2 for every verb, ``train --set`` typed and validated like
the file, defaults in every --help, ``--split`` for text sources, long sentences scored
in windows. The end-to-end run of every verb on a freshly trained model is slow."""

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from probformer import cli, demo
from probformer.training import checkpoint, corpus, data, run_config
from probformer.training import evaluate as evaluation
from tests.builders import TINY_PT_RUN as TINY


def run(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    try:
        status = cli.main([str(a) for a in argv])
    except SystemExit as exit:
        status = exit.code
    return status, capsys.readouterr().err


def no_work(*args, **kwargs):
    raise AssertionError("work started before the arguments were checked")


@pytest.mark.parametrize("steps", ["-5", "-1"])
def test_demo_refuses_bad_steps_before_the_oracles(tmp_path, monkeypatch, capsys, steps):
    monkeypatch.setattr(demo, "oracles_on_a_sentence", no_work)
    monkeypatch.setattr(demo, "train", no_work)
    status, err = run(["demo", "--steps", steps, "--out", "runs"], tmp_path, monkeypatch, capsys)
    assert status == 2 and err == f"probformer demo: error: --steps must be >= 0 (0: the configs' own), got {steps}\n"
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="--steps must be an integer >= 0"):
        demo.main(int(steps), str(tmp_path / "runs"))  # the library entry point checks first too


@pytest.mark.parametrize(
    "format, out, message",
    [
        ("onnx", "x.pt2", "--out x.pt2 does not end in .onnx, the file --format onnx writes"),
        ("exported", "y.onnx", "--out y.onnx does not end in .pt2, the file --format exported writes"),
        ("exported", "folder", "--out folder does not end in .pt2, the file --format exported writes"),
        ("torch", "z.onnx", "--out z.onnx names a .onnx file, but --format torch writes a folder (--format onnx?)"),
    ],
)
def test_export_refuses_a_suffix_that_is_not_its_format_before_loading(
    tmp_path, monkeypatch, capsys, format, out, message
):
    import probformer.deploy

    monkeypatch.setattr(probformer.deploy, "export", no_work)
    (tmp_path / "run").mkdir()
    status, err = run(["export", "run", "--format", format, "--out", out], tmp_path, monkeypatch, capsys)
    assert status == 2 and err == f"probformer export: error: {message}\n"
    assert [p.name for p in tmp_path.iterdir()] == ["run"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["mup", "coord-check", "--steps", "0"], "--steps must be >= 1, got 0"),
        (["mup", "coord-check", "--lr", "-1"], "--lr must be a finite number > 0, got -1.0"),
        (["mup", "coord-check", "--lr", "inf"], "--lr must be a finite number > 0, got inf"),
    ],
)
def test_mup_verbs_check_their_arguments_first(tmp_path, monkeypatch, capsys, argv, message):
    from probformer.mup import coord_check

    monkeypatch.setattr(coord_check, "main", no_work)
    status, err = run(argv, tmp_path, monkeypatch, capsys)
    assert status == 2 and message in err and len(err.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_coord_check_writes_outside_the_repository_by_default():
    args = cli.build_parser().parse_args(["mup", "coord-check"])
    assert args.out == "runs/coord-check"  # runs/ is ignored by git; docs/mup only when asked


def test_the_demo_prints_a_command_that_runs_as_printed(monkeypatch):
    import shlex
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    command = demo.cli_command()  # what the demo's "next" lines start with
    result = subprocess.run([*shlex.split(command), "--version"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("probformer ")


ROOT = Path(__file__).resolve().parents[2]


def probformer(*args, cwd, timeout=120):
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "probformer", *map(str, args)],
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def tiny_config(folder: Path, name="run.toml", steps=2, **replacements) -> Path:
    text = TINY.format(dropout=0.1, source="ptb", task="mlm", max_length=90, steps=steps)
    for old, new in replacements.items():
        assert old in text, old
        text = text.replace(old, new)
    path = folder / name
    path.write_text(text)
    return path


def test_version_is_the_installed_package_version(tmp_path):
    result = probformer("--version", cwd=tmp_path)
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout == f"probformer {importlib.metadata.version('probformer')}\n"


def test_every_help_shows_the_defaults():
    parser = cli.build_parser()
    pending, seen = [parser], []
    while pending:
        current = pending.pop()
        seen.append(current.prog)
        text = " ".join(current.format_help().split())
        for action in current._actions:
            if isinstance(action, argparse._SubParsersAction):
                pending.extend(action.choices.values())
                continue
            fixed = action.default is not None and action.default is not False  # (0 == False: compare by identity)
            if fixed and action.default not in ([], argparse.SUPPRESS) and not action.required:
                assert f"(default: {action.default})" in text, (current.prog, action.dest)
            elif action.option_strings and action.help != argparse.SUPPRESS and action.dest not in ("help", "version"):
                # no fixed default: the help says what an absent value means, or the option is a flag
                assert "default" in action.help or action.required or action.default is False, action.dest
    verbs = {"train", "evaluate", "diagnose", "export", "demo", "mup", "data", "fetch", "coord-check", "neighbourhood"}
    assert {prog.split()[-1] for prog in seen} >= verbs


# ---- user errors: one line, exit status 2, nothing created ------------------------------------
# Each verb's errors run as a subprocess, as a user meets them; the cases that would only
# repeat a subprocess already run (same verb, same path through main) run in-process, which
# saves interpreter and torch start-ups (make test's time budget).

SUBPROCESS, IN_PROCESS = "subprocess", "in-process"


def run_cli(how: str, argv: list, folder: Path, capsys, monkeypatch) -> tuple[int, str, str]:
    if how == SUBPROCESS:
        result = probformer(*argv, cwd=folder)
        return result.returncode, result.stdout, result.stderr
    monkeypatch.chdir(folder)
    try:
        status = cli.main([str(a) for a in argv])
    except SystemExit as exit:  # argparse's own errors exit
        status = exit.code
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize(
    "how, argv, message",
    [
        (SUBPROCESS, [], "probformer: error: the following arguments are required: VERB"),
        (SUBPROCESS, ["bogus"], "probformer: error: argument VERB: invalid choice: 'bogus'"),
        (SUBPROCESS, ["demo", "--steps", "many"], "probformer demo: error: argument --steps: invalid int value"),
        (SUBPROCESS, ["train", "--config", "no.toml"], "probformer train: error: config file no.toml does not exist"),
        (IN_PROCESS, ["train"], "probformer train: error: the following arguments are required: --config"),
        (SUBPROCESS, ["evaluate", "missing", "--task", "mlm"], "probformer evaluate: error: missing is neither a"),
        (IN_PROCESS, ["evaluate", "missing", "--task", "ppl"], "probformer evaluate: error: argument --task: invalid"),
        (SUBPROCESS, ["diagnose", "missing", "--out", "d"], "probformer diagnose: error: missing is neither a"),
        (IN_PROCESS, ["diagnose", "m", "--out", "d", "--sentences", "0"], "probformer diagnose: error: --sentences"),
        (SUBPROCESS, ["export", "missing", "--out", "x"], "probformer export: error: missing is neither a checkpoint"),
        (IN_PROCESS, ["export", "missing", "--out", "x", "--format", "tf"], "probformer export: error: argument"),
        (IN_PROCESS, ["mup"], "probformer mup: error: the following arguments are required: MUP_VERB"),
        (SUBPROCESS, ["mup", "coord-check", "--out", "c", "--widths", "64"], "probformer mup coord-check: error: "),
        (SUBPROCESS, ["mup", "neighbourhood", "--config", "no.toml"], "probformer mup neighbourhood: error: config"),
        (SUBPROCESS, ["data", "fetch", "no-such-set"], "probformer data fetch: error: unknown data set 'no-such-set'"),
    ],
)
def test_user_errors_of_every_verb_are_one_line(tmp_path, capsys, monkeypatch, how, argv, message):
    status, out, err = run_cli(how, argv, tmp_path, capsys, monkeypatch)
    assert status == 2, err
    assert err.startswith(message) and len(err.splitlines()) == 1, err
    assert out == "" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "how, replacements, overrides, message",
    [
        (
            SUBPROCESS,
            {"lr = 3e-3": "lr = 50.0"},
            [],
            "config key 'train.lr' must be a finite number in (0, 10], got 50",
        ),
        (IN_PROCESS, {"rank = 4": "ranks = 4"}, [], "unknown config keys ['model.ranks']"),
        (
            IN_PROCESS,
            {},
            ["--set", "train.lr=50.0"],
            "config key 'train.lr' must be a finite number in (0, 10], got 50",
        ),
        (SUBPROCESS, {}, ["--set", "train.learning_rate=1e-3"], "unknown config keys ['train.learning_rate']"),
        (SUBPROCESS, {}, ["--set", "model.rank=1.5"], "config key 'model.rank' must be of type int, got float 1.5"),
        (IN_PROCESS, {}, ["--set", "train.bf16=yes"], "config key 'train.bf16' must be of type bool, got str 'yes'"),
        (IN_PROCESS, {}, ["--set", 'model.weights={unary="1e400"}'], "config key 'model.weights.unary' must be"),
        (IN_PROCESS, {}, ["--set", "optimiser.lr=1"], "unknown config table 'optimiser'"),
        (IN_PROCESS, {}, ["--set", 'model.kind=["transformer"]'], "config key 'model.kind' must be one of"),
        (IN_PROCESS, {}, ["--set", "lr=1"], "expected TABLE.KEY=VALUE"),
    ],
)
def test_config_errors_are_one_line_naming_the_key(
    tmp_path, capsys, monkeypatch, how, replacements, overrides, message
):
    config = tiny_config(tmp_path, **replacements)
    status, _, err = run_cli(
        how, ["train", "--config", config, *overrides, "--out", "run"], tmp_path, capsys, monkeypatch
    )
    assert status == 2, err
    assert err.startswith("probformer train: error: ") and len(err.splitlines()) == 1
    assert message in err, err
    assert not (tmp_path / "run").exists()


def test_debug_shows_the_traceback(tmp_path):
    for argv in (["--debug", "train", "--config", "x.toml"], ["train", "--config", "x.toml", "--debug"]):
        result = probformer(*argv, cwd=tmp_path)
        assert result.returncode == 1
        assert "Traceback" in result.stderr and result.stderr.strip().endswith("config file x.toml does not exist")


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


# ---- --split of a text source; long sentences ------------------------------------------------


def test_text_splits_are_the_trainers(tmp_path):
    lines = [f"sentence {i} has words w{i % 7} and w{i % 5}" for i in range(45)]
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(lines) + "\n")
    # 45 lines: 45 // 20 = 2 held out for validation
    assert evaluation.read_split(str(text), "valid") == ([line.split() for line in lines[43:]], "valid")
    assert evaluation.read_split(str(text), "train") == ([line.split() for line in lines[:43]], "train")
    assert evaluation.read_split(str(text), None) == ([line.split() for line in lines], "all")
    with pytest.raises(ValueError, match="no test split"):
        evaluation.read_split(str(text), "test")
    with pytest.raises(ValueError, match="--split all is for a text file"):
        evaluation.read_split("ptb", "all")
    trained = corpus.prepare_corpus(run_config.DataConfig(source=str(text), vocabulary=60))
    valid, _ = evaluation.read_split(str(text), "valid")
    assert [ids for ids, _ in trained.valid] == [trained.vocabulary.encode(words) for words in valid]


def test_long_sentences_are_scored_in_windows_not_dropped(tmp_path):
    words = [f"w{i}" for i in range(20)]
    vocabulary = data.Vocabulary.build([words])
    torch.manual_seed(0)
    model = cli_model(len(vocabulary), max_length=8)
    checkpoint.save(model, tmp_path / "model", vocabulary)
    (tmp_path / "long.txt").write_text(" ".join(words) + "\n")  # 20 words: windows of 8, 8 and 4
    (tmp_path / "cut.txt").write_text("\n".join(" ".join(words[i : i + 8]) for i in (0, 8, 16)) + "\n")
    long = evaluation.evaluate(tmp_path / "model", "mlm", str(tmp_path / "long.txt"))
    cut = evaluation.evaluate(tmp_path / "model", "mlm", str(tmp_path / "cut.txt"))
    assert long["sentences"] == 1 and long["windowed"] == 1 and cut["windowed"] == 0
    assert long["loss"] == cut["loss"] and long["tokens"] == cut["tokens"] > 0


def cli_model(vocab_size: int, max_length: int):
    import probformer as pf

    config = pf.TransformerConfig(
        vocab_size=vocab_size, width=8, heads=2, layers=1, ffn_width=16, max_length=max_length
    )
    return pf.Transformer(config).eval()


def test_old_data_spelling_is_the_new():
    assert cli._old_data_spelling("ptb-valid", None) == ("ptb", "valid")
    assert cli._old_data_spelling("ptb-test", "test") == ("ptb", "test")
    assert cli._old_data_spelling("ptb", None) == ("ptb", None)
    with pytest.raises(ValueError, match="disagree"):
        cli._old_data_spelling("ptb-valid", "test")


def test_evaluate_reads_the_earlier_data_spelling_as_diagnose_does(tmp_path, monkeypatch, capsys):
    """--data ptb-test is --data ptb --split test (it reached the loader as a path)."""
    from probformer.training import evaluate as evaluation

    asked = []
    monkeypatch.setattr(evaluation, "evaluate", lambda *args: asked.append(args) or {"loss": 1.0})
    monkeypatch.setattr(evaluation, "print_table", lambda task, metrics: None)
    assert cli.main(["evaluate", str(tmp_path), "--task", "mlm", "--data", "ptb-test"]) == 0
    assert asked == [(str(tmp_path), "mlm", "ptb", "test", 0)]
    assert "mlm on ptb (test):" in capsys.readouterr().out


# ---- every verb end to end ---------------------------------------------------------------------


@pytest.mark.slow
def test_every_verb_on_a_freshly_trained_model(tmp_path):
    config = tiny_config(tmp_path, steps=4)
    text = tmp_path / "text.txt"
    text.write_text("\n".join(" ".join(s) for s in data.ptb_sentences("valid")[:40]) + "\n")
    runs = [
        ["train", "--config", config, "--set", "model.rank=8", "--set", "train.lr=1e-3", "--out", "run"],
        ["evaluate", "run", "--task", "mlm", "--sentences", "20"],
        ["evaluate", "run/model", "--task", "mlm", "--data", text, "--split", "valid"],
        ["diagnose", "run", "--data", "ptb", "--split", "test", "--sentences", "4", "--out", "diagnosis"],
        ["diagnose", "run/model", "--data", "ptb-valid", "--sentences", "4", "--out", "diagnosis-old"],
        ["export", "run", "--out", "exported"],
        ["mup", "coord-check", "--widths", "16,32", "--steps", "1", "--out", "coord"],
    ]
    outputs = []
    for argv in runs:
        result = probformer(*argv, cwd=tmp_path, timeout=600)
        assert result.returncode == 0, (argv, result.stderr[-2000:])
        assert "Warning" not in result.stderr and "Traceback" not in result.stderr, (argv, result.stderr[-2000:])
        outputs.append(result.stdout)
    assert json.loads((tmp_path / "run" / "run.json").read_text())["model"]["rank"] == 8
    assert "mlm on ptb (valid):" in outputs[1] and "sentences    20" in outputs[1]
    assert "sentences    2" in outputs[2]  # 40 lines: the last 2 are the valid split
    assert "on 4 sentences of ptb (test)" in outputs[3] and "on 4 sentences of ptb (valid)" in outputs[4]
    assert (tmp_path / "diagnosis" / "report.nc").is_file() and (tmp_path / "exported" / "config.json").is_file()
    assert (tmp_path / "coord" / "coord_check.json").is_file()
