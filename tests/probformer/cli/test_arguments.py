"""Arguments are checked before any work starts: ``demo --steps``, an ``export --out``
suffix that is not its format's, the mup verbs' options; ``coord-check`` writes outside the
repository by default, ``--version`` is the installed package's version and every
``--help`` shows the defaults."""

import argparse
import importlib.metadata

import pytest

from probformer import cli, demo
from tests.probformer.cli.commands import probformer


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
