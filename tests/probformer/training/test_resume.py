"""A run survives SIGKILL at any instant: killed (by the crash-point hook, at named
points inside a step, a metrics write, every stage of a save including the last one,
and the final model write; or at a random time), ``--resume`` finishes it with final
weights equal byte for byte and a metrics file equal line for line to an uninterrupted
run's (wall-clock fields aside: ``elapsed`` and ``tokens_per_second``)."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from probformer.training import checkpoint, crash_points
from probformer.training.run_log import WALL_CLOCK_KEYS
from probformer.training.trainer import latest_checkpoint, train
from tests.processes import fork_context

# six steps, a checkpoint after every one, a metrics line every second step (so a
# checkpoint at an odd step holds half a loss window), a validation at step 3
TINY = """
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
task = "mlm"
train_sentences = 32
valid_sentences = 8
max_length = 90
vocabulary = 200

[train]
batch_size = 8
lr = 3e-3
warmup_steps = 2
steps = 6
checkpoint_every = 1
eval_every = 3
eval_sentences = 4
log_every = 2
threads = 1
"""


def comparable(run) -> tuple[bytes, list[dict]]:
    """What must equal between two runs: the final weights' bytes and the metrics
    without their wall-clock fields."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    timeless = [{k: v for k, v in r.items() if k not in WALL_CLOCK_KEYS} for r in records]
    return (run / "model" / "model.safetensors").read_bytes(), timeless


def leftovers(run) -> list[str]:
    """Anything a killed process could leave half-written."""
    names = [p.relative_to(run).as_posix() for p in run.rglob("*")]
    return [n for n in names if ".tmp-" in n or ".old-" in n or "/.tmp" in n]


def cli(*args, env=None):
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    command = [sys.executable, "-m", "probformer", "train", *args]
    return subprocess.Popen(command, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reference")
    (folder / "tiny.toml").write_text(TINY)
    train(folder / "tiny.toml", folder / "run", progress=False)
    return folder / "tiny.toml", comparable(folder / "run")


def assert_resumes_identically(run, config, expected):
    if (run / "checkpoints" / "latest").is_file():
        checkpoint.load(latest_checkpoint(run))  # whatever the moment: the pointer names a good checkpoint
    train(config, run, resume=True, progress=False)
    weights, records = comparable(run)
    assert weights == expected[0], "final weights differ from the uninterrupted run"
    assert records == expected[1]  # one line per logged step and split, none twice, equal floats
    assert leftovers(run) == []
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step-0000006"]


POINTS = [
    "step@1",  # before the first checkpoint: the resume starts again
    "step@4",  # checkpoint 3 holds half a loss window: it must be restored
    "metrics:partial@2",  # half a line in metrics.jsonl
    "save:weights@3",  # temporary checkpoint half written
    "save:temporary@5",  # temporary complete, not renamed
    "save:renamed@2",  # renamed, pointer not moved
    "save:pointer@4",  # pointer moved, older checkpoint not pruned
    "save:temporary@6",  # the last step's checkpoint
    "final:logged",  # final validation line written: it must not appear twice
    "final:model",  # model folder written, summary not
]


def train_until_killed(point: str, config, run) -> None:
    os.environ[crash_points.ENVIRONMENT] = point
    train(config, run, progress=False)


@pytest.mark.parametrize("point", POINTS)
def test_sigkill_at_a_named_point_resumes_to_the_uninterrupted_run(tmp_path, reference, point):
    config, expected = reference
    run = tmp_path / "run"
    # a child forked from a JAX-free server with the trainer imported (tests/processes.py) kills
    # itself at the point; the CLI path is the random-time test's
    child = fork_context().Process(target=train_until_killed, args=(point, config, run))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == -signal.SIGKILL, f"the run was not killed at {point} (exit code {child.exitcode})"
    assert not (run / "summary.json").exists()
    assert_resumes_identically(run, config, expected)


def test_resuming_a_finished_run_changes_nothing(tmp_path, reference):
    config, expected = reference
    train(config, tmp_path / "run", progress=False)
    assert_resumes_identically(tmp_path / "run", config, expected)


def test_sigkill_at_a_random_time_resumes_through_the_cli(tmp_path, reference):
    config, expected = reference
    run = tmp_path / "run"
    process = cli("--config", str(config), "--out", str(run))
    deadline = time.time() + 120
    while not (run / "run.json").is_file() and process.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    time.sleep(random.Random(2026).uniform(0.0, 0.8))  # somewhere in the six steps, saves and final write
    process.send_signal(signal.SIGKILL)
    process.wait()
    resumed = cli("--config", str(config), "--out", str(run), "--resume")
    _, error = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, error.decode()[-2000:]
    assert comparable(run) == expected
    assert leftovers(run) == []


def test_an_unknown_crash_point_is_refused(monkeypatch):
    monkeypatch.setenv(crash_points.ENVIRONMENT, "save:nowhere")
    with pytest.raises(ValueError, match="must be one of"):
        crash_points.reached("step")


@pytest.mark.slow
def test_one_hundred_random_sigkills_resume_identically(tmp_path):
    """The kill-and-resume acceptance loop (also ``python benchmarks/kill_resume.py``)."""
    from benchmarks.kill_resume import kill_and_resume

    result = kill_and_resume(trials=100, folder=tmp_path, seed=0)
    assert result["killed"] == 100
    assert result["identical"] == 100, result["failures"][:5]
