"""Resuming a run: after SIGKILL it reproduces the uninterrupted run bit for bit; a changed
config, another vocabulary or a missing run is refused, more steps are allowed, and a run
written before a config key existed resumes while the key keeps its default."""

import json
import signal
import subprocess
import time

import pytest

from probformer.training import checkpoint, run_config
from probformer.training.trainer import Trainer, latest_checkpoint, train
from tests.builders import TINY_PT_RUN as TINY
from tests.builders import train_losses
from tests.builders import write_tiny_run_config as write_config
from tests.probformer.training.trainer.cli_process import cli


@pytest.mark.slow
def test_resume_after_sigkill_reproduces_the_uninterrupted_run(tmp_path):
    """A longer CLI run killed after its fourth checkpoint; make test covers the same path in
    tests/probformer/training/test_resume.py (every named crash point, and a CLI kill at a random time)."""
    config = write_config(tmp_path, steps=40)
    full = tmp_path / "full"
    train(config, full, progress=False)
    killed = tmp_path / "killed"
    process = cli(
        "train", "--config", str(config), "--out", str(killed), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    pointer = killed / "checkpoints" / "latest"
    deadline = time.time() + 120
    while time.time() < deadline and not (pointer.is_file() and pointer.read_text() >= "step-0000004"):
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert pointer.is_file(), "no checkpoint was written before the kill"
    assert not (killed / "summary.json").exists(), "the run finished before the kill: nothing was tested"
    model, vocabulary = checkpoint.load(latest_checkpoint(killed))  # whatever moment: loadable
    assert vocabulary is not None
    resumed = cli("train", "--config", str(config), "--out", str(killed), "--resume", stderr=subprocess.PIPE)
    _, error = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, error.decode()[-2000:]
    assert train_losses(killed) == train_losses(full)  # bit-identical, every step
    summary_full = json.loads((full / "summary.json").read_text())
    summary_killed = json.loads((killed / "summary.json").read_text())
    assert summary_full["valid"] == summary_killed["valid"]


def test_resume_refuses_a_changed_config(tmp_path):
    config = write_config(tmp_path, steps=2)
    train(config, tmp_path / "run", progress=False)
    changed = write_config(tmp_path, name="changed.toml", dropout=0.2, steps=4)
    with pytest.raises(ValueError, match="model.dropout"):
        Trainer(run_config.load(changed), tmp_path / "run", resume=True)
    longer = write_config(tmp_path, name="longer.toml", steps=4)  # more steps is allowed
    summary = train(longer, tmp_path / "run", resume=True, progress=False)
    assert summary["steps"] == 4
    with pytest.raises(FileExistsError, match="--resume"):
        Trainer(run_config.load(longer), tmp_path / "run")


def test_resume_of_a_run_from_before_a_config_key_existed(tmp_path):
    """A run.json written before a key was added (so without it) resumes when the key is at
    its default, and is refused when the key is set to something else."""
    config = write_config(tmp_path, steps=2)
    train(config, tmp_path / "run", progress=False)
    saved = json.loads((tmp_path / "run" / "run.json").read_text())
    assert saved["data"].pop("long_sentences") == "error"  # as if written before data.long_sentences
    (tmp_path / "run" / "run.json").write_text(json.dumps(saved))
    longer = write_config(tmp_path, name="longer.toml", steps=3)
    assert train(longer, tmp_path / "run", resume=True, progress=False)["steps"] == 3
    (tmp_path / "run" / "run.json").write_text(json.dumps(saved))
    (tmp_path / "other.toml").write_text(longer.read_text().replace("[data]", '[data]\nlong_sentences = "windows"'))
    with pytest.raises(ValueError, match="data.long_sentences"):
        Trainer(run_config.load(tmp_path / "other.toml"), tmp_path / "run", resume=True)


def test_vocabulary_mismatch_on_resume(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"the cat number {i} sat on mat {i % 7}" for i in range(200)))
    config = TINY.format(dropout=0.1, source=corpus, task="mlm", max_length=40, steps=2)
    (tmp_path / "c.toml").write_text(config)
    train(tmp_path / "c.toml", tmp_path / "run", progress=False)
    corpus.write_text("\n".join(f"a dog called {i} ran past house {i % 5} quickly" for i in range(200)))
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        Trainer(run_config.load(tmp_path / "c.toml"), tmp_path / "run", resume=True)


def test_resume_of_a_missing_run_is_refused_without_creating_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing to resume"):
        train(write_config(tmp_path, steps=2), tmp_path / "nowhere", resume=True, progress=False)
    assert not (tmp_path / "nowhere").exists()
