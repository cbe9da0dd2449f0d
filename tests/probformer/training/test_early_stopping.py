"""Early stopping (``train.patience``): the run stops at the first periodic validation that
ends ``patience`` validations in a row without a new best loss, and a run killed at any
point around that decision resumes to the uninterrupted run's weights and metrics."""

import json
import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from probformer.training import run_config
from probformer.training.early_stopping import EarlyStopping
from probformer.training.run_log import WALL_CLOCK_KEYS
from probformer.training.trainer import train


def stop_index(losses: list[float], patience: int) -> int | None:
    """The oracle: the index of the validation after which training stops, written from
    the definition (the count of validations since the last strict improvement)."""
    for index in range(len(losses)):
        best_at = min(range(index + 1), key=lambda i: (losses[i], i))  # first occurrence of the minimum so far
        if patience and index - best_at >= patience:
            return index
    return None


@given(
    losses=st.lists(st.sampled_from([1.0, 2.0, 3.0, 2.5, 0.5, 4.0]), min_size=1, max_size=12),
    patience=st.integers(0, 4),
)
def test_the_stop_matches_the_definition(losses, patience):
    early = EarlyStopping(patience)
    stopped = None
    for index, loss in enumerate(losses):
        early.update(loss, step=10 * (index + 1))
        if early.stop:
            stopped = index
            break
    assert stopped == stop_index(losses, patience)
    seen = losses[: len(losses) if stopped is None else stopped + 1]
    assert early.best_loss == min(seen)
    assert early.best_step == 10 * (seen.index(min(seen)) + 1)


def test_the_state_survives_strict_json():
    early = EarlyStopping(3)
    restored = EarlyStopping(3)
    restored.restore(json.loads(json.dumps(early.state(), allow_nan=False)))  # no best yet: no Infinity
    assert restored == early
    early.update(2.0, 5)
    early.update(2.5, 10)
    restored.restore(json.loads(json.dumps(early.state(), allow_nan=False)))
    assert restored == early


def test_patience_needs_periodic_validation(tmp_path):
    with pytest.raises(ValueError, match=r"train\.patience.*train\.eval_every"):
        run_config.TrainConfig(patience=3, eval_every=0)
    with pytest.raises(ValueError, match=r"train\.patience"):
        run_config.TrainConfig(patience=-1, eval_every=10)


# An lr far below float32's resolution: the weights never change, so every validation
# loss equals the first and the run must stop at the third validation (step 6 of 20).
FROZEN = """
[model]
kind = "probabilistic_transformer"
labels = 8
channels = 2
rank = 2
iterations = 1
dropout = 0.1
mup = true

[data]
source = "ptb"
train_sentences = 48
valid_sentences = 8
max_length = 90
vocabulary = 200

[train]
batch_size = 8
lr = 1e-12
warmup_steps = 0
steps = 20
eval_every = 2
patience = 2
checkpoint_every = 2
log_every = 1
diagnostics_every = 0
threads = 1
"""


def records(run) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in WALL_CLOCK_KEYS} for line in lines]


@pytest.fixture(scope="module")
def frozen(tmp_path_factory):
    folder = tmp_path_factory.mktemp("frozen")
    (folder / "frozen.toml").write_text(FROZEN)
    summary = train(folder / "frozen.toml", folder / "run", progress=False)
    return folder / "frozen.toml", folder / "run", summary


def test_a_run_that_stops_improving_stops_where_the_definition_says(frozen):
    _, run, summary = frozen
    periodic = [r for r in records(run) if r["split"] == "valid" and not r.get("final")]
    losses = [r["loss"] for r in periodic]
    index = stop_index(losses, patience=2)
    assert index is not None and periodic[index]["step"] == summary["steps"] == 6
    assert summary["stopped_early"] is True
    assert summary["best_periodic_valid"] == {"loss": losses[0], "step": 2}
    assert max(r["step"] for r in records(run) if r["split"] == "train") == 6
    assert (run / "checkpoints" / "step-0000006").is_dir() and (run / "model").is_dir()


@pytest.mark.parametrize("point", ["step@5", "save:pointer@3", "final:logged"])
def test_a_run_killed_around_the_stop_resumes_to_the_same_run(tmp_path, frozen, point):
    config, reference, _ = frozen
    run = tmp_path / "run"
    command = [sys.executable, "-m", "probformer", "train", "--config", str(config), "--out", str(run)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PROBFORMER_CRASH_AT": point}
    killed = subprocess.run(command, env=environment, capture_output=True, timeout=300)
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]
    environment.pop("PROBFORMER_CRASH_AT")
    resumed = subprocess.run([*command, "--resume"], env=environment, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from step" in resumed.stdout
    assert records(run) == records(reference)
    model = "model/model.safetensors"
    assert (run / model).read_bytes() == (reference / model).read_bytes()
    assert json.loads((run / "summary.json").read_text())["steps"] == 6
