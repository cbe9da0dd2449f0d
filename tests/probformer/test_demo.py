"""``make demo`` end to end, shortened to a few steps per model."""

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
