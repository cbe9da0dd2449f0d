"""Failures mid-run keep the last good checkpoint: a non-finite loss stops the run at its
step (and the run resumes from that checkpoint), non-finite weights are never
checkpointed, and a full disk or an unwritable folder ends in one clear error naming the
path, with nothing half-written."""

import math
import re
import subprocess
from pathlib import Path

import pytest
import torch

from probformer.training import checkpoint, run_config
from probformer.training.trainer import Trainer, latest_checkpoint, train
from tests.builders import write_tiny_run_config as write_config
from tests.probformer.training.trainer.cli_process import cli

# ---- non-finite numbers stop the run and keep the last good checkpoint ---------------------


def final_weights(run: Path) -> bytes:
    return (run / "model" / "model.safetensors").read_bytes()


def test_a_non_finite_loss_stops_at_its_step_and_the_last_checkpoint_resumes(tmp_path, monkeypatch):
    config = write_config(tmp_path, steps=6)
    train(config, tmp_path / "full", progress=False)
    trainer = Trainer(run_config.load(config), tmp_path / "run", progress=False)
    forward = trainer.wrapped.forward

    def poisoned(*args, **kwargs):  # the fifth step's logits are NaN
        logits, output = forward(*args, **kwargs)
        return (logits * math.nan if trainer.step == 4 else logits), output

    monkeypatch.setattr(trainer.wrapped, "forward", poisoned)
    with pytest.raises(FloatingPointError, match=r"training stopped at step 5: the loss is nan") as error:
        trainer.run()
    assert "step-0000004, is kept" in str(error.value)
    assert latest_checkpoint(tmp_path / "run").name == "step-0000004"
    assert not (tmp_path / "run" / "model").exists()
    train(config, tmp_path / "run", resume=True, progress=False)  # from the last good checkpoint
    assert final_weights(tmp_path / "run") == final_weights(tmp_path / "full")


def test_non_finite_weights_after_a_step_are_never_checkpointed(tmp_path, monkeypatch):
    trainer = Trainer(run_config.load(write_config(tmp_path, steps=6)), tmp_path / "run", progress=False)
    step = trainer.optimizer.step

    def overflowing(*args, **kwargs):
        step(*args, **kwargs)
        if trainer.step == 5:  # the last step's update overflows a weight (no evaluation follows it)
            with torch.no_grad():
                next(trainer.model.parameters()).view(-1)[0] = math.inf

    monkeypatch.setattr(trainer.optimizer, "step", overflowing)
    name = next(n for n, _ in trainer.model.named_parameters())
    refused = rf"parameters after step 6: tensor '{re.escape(name)}' holds NaN or infinite"
    with pytest.raises(FloatingPointError, match=refused):
        trainer.run()
    assert latest_checkpoint(tmp_path / "run").name == "step-0000004"
    assert not (tmp_path / "run" / "model").exists()
    checkpoint.load(latest_checkpoint(tmp_path / "run"))


# ---- failed writes: one clear error naming the path, nothing half-written -----------------------


def stale(run: Path) -> list[str]:
    return [p.name for p in run.rglob("*") if ".tmp" in p.name or ".old-" in p.name]


def test_disk_full_during_a_checkpoint(tmp_path, monkeypatch):
    import errno

    from probformer.training import run_checkpoints

    config = write_config(tmp_path, steps=6)
    writes, write = [], run_checkpoints.save_file

    def filling_up(tensors, path):
        writes.append(path)
        if len(writes) == 2:  # the second checkpoint finds the disk full
            raise OSError(errno.ENOSPC, "No space left on device")
        write(tensors, path)

    monkeypatch.setattr(run_checkpoints, "save_file", filling_up)
    with pytest.raises(checkpoint.WriteError, match=r"cannot write .*checkpoints/step-0000004: No space left") as e:
        train(config, tmp_path / "run", progress=False)
    assert e.value.__cause__ is None and e.value.__suppress_context__  # one error, not a chain from inside
    assert latest_checkpoint(tmp_path / "run").name == "step-0000002"
    assert stale(tmp_path / "run") == []
    monkeypatch.undo()
    assert train(config, tmp_path / "run", resume=True, progress=False)["steps"] == 6


def test_unwritable_checkpoint_folder_and_run_folder(tmp_path):
    from tests.builders import unwritable

    config = write_config(tmp_path, steps=2)
    train(config, tmp_path / "run", progress=False)
    longer = write_config(tmp_path, name="longer.toml", steps=4)
    with unwritable(tmp_path / "run" / "checkpoints"):
        with pytest.raises(
            checkpoint.WriteError, match=r"cannot write .*checkpoints/step-0000004: .*(denied|permitted)"
        ):
            train(longer, tmp_path / "run", resume=True, progress=False)
        assert latest_checkpoint(tmp_path / "run").name == "step-0000002"
    assert stale(tmp_path / "run") == []
    assert train(longer, tmp_path / "run", resume=True, progress=False)["steps"] == 4
    with unwritable(tmp_path / "locked") as locked:
        process = cli("train", "--config", str(config), "--out", str(locked / "run"), stderr=subprocess.PIPE)
        _, error = process.communicate(timeout=120)
        assert process.returncode == 1
        assert f"probformer train: error: cannot write {locked / 'run'}" in error.decode()
        assert "Traceback" not in error.decode()
