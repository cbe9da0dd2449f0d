"""Every verb end to end on a freshly trained model, as a user runs them one after another
(train with ``--set``, evaluate, diagnose, export, mup coord-check): slow."""

import json

import pytest

from probformer.training import data
from tests.probformer.cli.commands import probformer, tiny_config


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
