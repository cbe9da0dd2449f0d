"""The best validation's model: a run with periodic validation keeps, in ``best/``, the model
of its best validation loss so far (``model/`` is the last step's). Checked against what the
run logged: ``best/`` scores, on the validation sentences the run validated on, exactly the
lowest periodic loss in metrics.jsonl, at the step of that loss; and a kill right after
``best/`` is written resumes to the uninterrupted run, ``best/`` included."""

import json
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from probformer.training import checkpoint, run_checkpoints, run_config
from probformer.training.corpus import prepare_corpus
from probformer.training.trainer import train
from probformer.training.validation import evaluate_model

# lr high enough that the validation loss falls, then rises at least once in 16 steps
RUN = """
[model]
kind = "probabilistic_transformer"
labels = 8
channels = 2
rank = 2
iterations = 1
dropout = 0.0
mup = true

[data]
source = "ptb"
train_sentences = 48
valid_sentences = 8
max_length = 90
vocabulary = 200

[train]
batch_size = 8
lr = {lr}
warmup_steps = 0
steps = 16
eval_every = 2
eval_sentences = 6
patience = {patience}
checkpoint_every = 4
log_every = 2
diagnostics_every = 0
threads = 1
"""


def periodic(run) -> list[dict]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if r["split"] == "valid" and not r.get("final")]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("best")
    (folder / "run.toml").write_text(RUN.format(lr=0.3, patience=0))
    summary = train(folder / "run.toml", folder / "run", progress=False)
    return folder / "run.toml", folder / "run", summary


def test_best_holds_the_model_of_the_lowest_logged_validation_loss(trained):
    config_path, run, summary = trained
    validations = periodic(run)
    lowest = min(validations, key=lambda r: r["loss"])
    assert len(validations) == 7  # steps 2, 4, ..., 14; the last step has the final validation only
    assert any(b["loss"] > a["loss"] for a, b in zip(validations, validations[1:])), "never worse: nothing tested"
    config = run_config.load(config_path)
    corpus = prepare_corpus(config.data)
    best, _ = checkpoint.load(run / "best")
    scored = evaluate_model(best, corpus.valid[: config.train.eval_sentences], "mlm", len(corpus.vocabulary))
    assert scored["loss"] == lowest["loss"]
    last, _ = checkpoint.load(run / "model")
    assert summary["steps"] == 16 and lowest["step"] < 16
    assert (run / "best" / "model.safetensors").read_bytes() != (run / "model" / "model.safetensors").read_bytes()
    assert sum(p.numel() for p in last.parameters()) == sum(p.numel() for p in best.parameters())


def test_a_final_validation_below_every_periodic_one_is_the_best_where_it_scores_the_same_sentences(tmp_path):
    """The run's last step has no periodic validation, only the final one (all sentences):
    where the periodic ones score all sentences too, a lower final loss makes the last model
    the best; where they score a subset, the losses are not comparable and best/ stays."""
    for eval_sentences, final_is_best in ((0, True), (6, False)):
        folder = tmp_path / str(eval_sentences)
        folder.mkdir()
        text = RUN.format(lr=0.003, patience=0).replace("eval_sentences = 6", f"eval_sentences = {eval_sentences}")
        (folder / "run.toml").write_text(text)
        train(folder / "run.toml", folder / "run", progress=False)
        lines = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
        final = next(r for r in lines if r.get("final"))
        if eval_sentences == 0:
            assert final["loss"] < min(r["loss"] for r in periodic(folder / "run")), "not a case where it matters"
        run = folder / "run"
        same = (run / "best/model.safetensors").read_bytes() == (run / "model/model.safetensors").read_bytes()
        assert same == final_is_best


def train_command(config, run) -> list[str]:
    return [sys.executable, "-m", "probformer", "train", "--config", str(config), "--out", str(run)]


def killed_at(point: str, config, run) -> None:
    """Train ``config`` into ``run`` in a process that SIGKILLs itself at crash point ``point``."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PROBFORMER_CRASH_AT": point}
    killed = subprocess.run(train_command(config, run), env=environment, capture_output=True, timeout=300)
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]


def resume_to_the_reference(config, run, reference) -> None:
    """``--resume`` the killed run: it ends with the uninterrupted run's best/ and model/ bytes."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [*train_command(config, run), "--resume"]
    resumed = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    for folder in ("best", "model"):
        weights = f"{folder}/model.safetensors"
        assert (run / weights).read_bytes() == (reference / weights).read_bytes()


def test_a_kill_right_after_best_is_written_resumes_to_the_same_run(tmp_path, trained):
    config, reference, _ = trained
    run = tmp_path / "run"
    killed_at("best:model@3", config, run)
    assert (run / "best").is_dir() and not (run / "model").exists()
    resume_to_the_reference(config, run, reference)
    assert not [p.name for p in run.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_a_kill_between_the_two_renames_of_a_swap_loses_no_best_folder(tmp_path, trained):
    """The second new best replaces best/: killed after the old folder is moved aside and
    before the new one is in, best/ is missing. Cleaning up moves the old one back (not
    deleting both copies), and the resumed run ends with the uninterrupted run's bytes."""
    config, reference, _ = trained
    run = tmp_path / "run"
    killed_at("swap:moved@1", config, run)
    assert not (run / "best").exists()
    [old] = run.glob(".best.old-*")
    [new] = run.glob(".best.tmp-*")
    previous, names = (old / "model.safetensors").read_bytes(), sorted(p.name for p in old.iterdir())
    assert previous != (new / "model.safetensors").read_bytes()
    run_checkpoints.remove_stale_temporaries(run)
    assert (run / "best" / "model.safetensors").read_bytes() == previous
    assert sorted(p.name for p in (run / "best").iterdir()) == names
    assert not [p.name for p in run.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    checkpoint.load(run / "best")  # a whole model folder, readable
    resume_to_the_reference(config, run, reference)


@given(st.lists(st.floats(0.5, 9.0), min_size=1, max_size=8))
@settings(max_examples=50, deadline=None)
def test_a_new_best_is_exactly_a_loss_below_every_earlier_one(losses):
    """When the trainer writes best/: EarlyStopping's best_step equals the step just validated
    exactly when that loss is below all earlier ones (ties keep the earlier model)."""
    from probformer.training.early_stopping import EarlyStopping

    early = EarlyStopping(patience=0)
    for index, loss in enumerate(losses):
        early.update(loss, step=index + 1)
        assert (early.best_step == index + 1) == all(loss < earlier for earlier in losses[:index])
