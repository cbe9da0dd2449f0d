"""Every argument is checked before any work: the demo refuses a bad --steps before its
oracles run, export refuses an --out that does not match --format before anything is
loaded or traced, and the μP verbs refuse bad values before torch is imported."""

import pytest

from probformer import cli, demo


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
