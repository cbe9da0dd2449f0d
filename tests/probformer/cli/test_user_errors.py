"""User errors: one line, exit status 2, nothing created, for every verb (each verb's
errors as a subprocess, as a user meets them; cases that would only repeat one in-process);
config errors name the key, from the file or from ``--set``; ``--debug`` shows the
traceback."""

from pathlib import Path

import pytest

from probformer import cli
from tests.probformer.cli.commands import probformer, tiny_config

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
