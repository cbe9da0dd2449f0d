"""``make demo`` end to end, shortened to a few steps per model, and the command the demo
prints for the reader to run next, which runs as printed."""

import json

from probformer import demo


def test_demo_trains_both_models_and_writes_everything(tmp_path, capsys):
    assert demo.main(steps=2, out=str(tmp_path)) == 0
    printed = capsys.readouterr().out
    assert "demo-pt" in printed and "demo-bert" in printed and "where everything is" in printed
    for name in ("demo-pt", "demo-bert"):
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["steps"] == 2 and summary["valid"]["perplexity"] > 1
        assert (tmp_path / name / "model" / "model.safetensors").is_file()
        assert (tmp_path / name / "loss.png").is_file()
    assert (tmp_path / "demo-pt" / "diagnostics" / "report.nc").is_file()
    exported = tmp_path / "demo-pt" / "export"
    assert (exported / "torch" / "model.safetensors").is_file() and (exported / "model.onnx").is_file()
    assert "PT exported" in printed


def test_the_demo_prints_a_command_that_runs_as_printed(monkeypatch):
    import shlex
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    command = demo.cli_command()  # what the demo's "next" lines start with
    result = subprocess.run([*shlex.split(command), "--version"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("probformer ")
