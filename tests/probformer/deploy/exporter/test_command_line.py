"""``probformer export`` on the command line: a checkpoint exported to a ``.pt2`` that
reproduces it, and user errors (a path that is neither a checkpoint nor a run) as one line
with exit status 2 and nothing written."""

import subprocess
import sys

import pytest

import probformer
from probformer import cli
from probformer.training import checkpoint
from tests.probformer.deploy.exporter.tiny_models import assert_reproduces, particle


def test_cli_export(tmp_path, capsys):
    model = particle()
    checkpoint.save(model, tmp_path / "checkpoint")
    assert (
        cli.main(["export", str(tmp_path / "checkpoint"), "--format", "exported", "--out", str(tmp_path / "m.pt2")])
        == 0
    )
    assert "wrote" in capsys.readouterr().out
    assert_reproduces(model, probformer.load(tmp_path / "m.pt2"))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["export", "nowhere", "--out", "x"], "probformer export: error: nowhere is neither a checkpoint"),
        (["diagnose", "nowhere", "--data", "missing.txt", "--out", "d"], "probformer diagnose: error: "),
    ],
)
def test_cli_user_errors_are_one_line(tmp_path, argv, message):
    result = subprocess.run(
        [sys.executable, "-m", "probformer", *argv], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2
    assert result.stderr.startswith(message) and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "d").exists()
