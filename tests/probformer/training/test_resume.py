"""A run survives SIGKILL at any instant: killed (by the crash-point hook, at named
points inside a step, a metrics write, every stage of a save including the last one,
and the final model write; or at a random time), ``--resume`` finishes it with final
weights equal byte for byte and a metrics file equal line for line to an uninterrupted
run's (wall-clock fields aside: ``elapsed`` and ``tokens_per_second``)."""

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from probformer.training import checkpoint, crash_points, run_config
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


# ---- damaged run files are refused naming the file and the key ---------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
TABLES = st.sampled_from(["model", "data", "train"])


@settings(max_examples=80, deadline=None)
@given(record=JSON | st.dictionaries(TABLES, JSON | st.dictionaries(st.text(max_size=4), JSON, max_size=2), max_size=3))
def test_any_run_json_is_resumed_or_refused_naming_it(tmp_path_factory, record):
    """Oracle: a run.json that is not an object of the three config tables is a ValueError
    naming it (it was a JSONDecodeError, an AttributeError or "'int' object is not
    iterable"); one that is goes on to the config comparison."""
    from probformer.training.resume import resume_source

    run = tmp_path_factory.mktemp("run")
    (run / "run.json").write_text(json.dumps(record))
    config = run_config.RunConfig.from_dict(tomllib.loads(TINY))
    tables = isinstance(record, dict) and all(isinstance(record.get(t), dict) for t in ("model", "data", "train"))
    if tables:
        try:
            resume_source(run, config)
        except ValueError as error:
            assert "--resume with a different config" in str(error)
    else:
        with pytest.raises(ValueError, match=re.escape(str(run / "run.json"))):
            resume_source(run, config)


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    """A training checkpoint as the trainer writes it (AdamW moments after one step)."""
    from probformer.models import registry
    from probformer.training import run_checkpoints

    torch.manual_seed(0)
    model = registry.build("transformer", {"vocab_size": 8, "width": 8, "heads": 2, "layers": 1, "ffn_width": 8})
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.tensor([[3, 4, 5]]))[0].sum().backward()
    optimizer.step()
    counters = {"step": 1, "epoch": 0, "batch_in_epoch": 1, "tokens_seen": 3, "elapsed": 0.5, "tags": None}
    counters |= {"early_stopping": {"best_loss": None}, "metrics_lines": 1, "window_loss": 0.0, "window_steps": 0}
    folder = run_checkpoints.save_training_checkpoint(
        tmp_path_factory.mktemp("run"), 1, model, optimizer, None, counters
    )
    return folder, model


def restore_copy(saved_checkpoint, target, edit_json=None, edit_tensors=None):
    from safetensors.torch import load_file, save_file

    from probformer.training import run_checkpoints

    folder, model = saved_checkpoint
    copy = shutil.copytree(folder, target)
    if edit_json is not None:
        (copy / "training.json").write_text(edit_json(json.loads((copy / "training.json").read_text())))
    if edit_tensors is not None:
        tensors = load_file(str(copy / "training.safetensors"))
        save_file(edit_tensors(tensors), str(copy / "training.safetensors"))
    return run_checkpoints.restore_training_checkpoint(copy, model, torch.optim.AdamW(model.parameters())), copy


# the types a resume needs, restated here: the oracle of which edits are refused
REQUIRED = ("step", "epoch", "batch_in_epoch", "tokens_seen", "elapsed", "param_groups")
WRONG = ["x", None, [], {}, True, 1.5]
# (key, value) edits that are still good state (an empty param_groups is refused when it is loaded)
STILL_GOOD = {("tags", None), ("tags", "[]"), ("early_stopping", "{}"), ("elapsed", 1.5), ("window_loss", 1.5)}


@settings(max_examples=60, deadline=None)
@given(
    dropped=st.sets(st.sampled_from([*REQUIRED, "tags", "metrics_lines", "early_stopping"]), max_size=2),
    changed=st.dictionaries(
        st.sampled_from([*REQUIRED, "tags", "early_stopping", "window_loss"]), st.sampled_from(WRONG), max_size=2
    ),
)
def test_a_damaged_training_json_is_refused_naming_it(saved_checkpoint, tmp_path_factory, dropped, changed):
    """Oracle: a required key missing, or a key holding a value of another type, is a
    ValueError naming training.json (it was a KeyError traceback); anything else restores."""

    def edit(record):
        record = {k: v for k, v in record.items() if k not in dropped}
        return json.dumps({**record, **changed})

    key = lambda value: json.dumps(value) if isinstance(value, list | dict) else value  # noqa: E731
    refused = bool(set(dropped) & set(REQUIRED)) or any((k, key(v)) not in STILL_GOOD for k, v in changed.items())
    target = tmp_path_factory.mktemp("copy") / "step"
    if refused:
        with pytest.raises(ValueError, match=re.escape(str(target / "training.json"))):
            restore_copy(saved_checkpoint, target, edit)
    else:
        counters, _ = restore_copy(saved_checkpoint, target, edit)
        assert counters["step"] == 1


@pytest.mark.parametrize(
    "edit",
    [
        lambda tensors: {k: v for k, v in tensors.items() if k != "rng.torch"},
        lambda tensors: {**tensors, "rng.torch": torch.zeros(3)},
        lambda tensors: {**tensors, "optimizer.first.exp_avg": torch.zeros(2)},
    ],
    ids=["no rng", "bad rng", "bad optimizer name"],
)
def test_a_damaged_training_safetensors_is_refused_naming_it(saved_checkpoint, tmp_path, edit):
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "step" / "training.safetensors"))):
        restore_copy(saved_checkpoint, tmp_path / "step", edit_tensors=edit)


@pytest.mark.parametrize(
    "file, content",
    [("run.json", "garbage"), ("run.json", "[1,2]"), ("run.json", '{"model": 5}'), ("training.json", "{}")],
)
def test_train_resume_of_a_damaged_run_is_one_error_naming_the_file(tmp_path, reference, file, content):
    """Through the CLI, as a user meets it: one line naming the file, no traceback."""
    config, _ = reference
    run = shutil.copytree(config.parent / "run", tmp_path / "run")
    damaged = run / file if file == "run.json" else latest_checkpoint(run) / file
    damaged.write_text(content)
    result = subprocess.run(
        [sys.executable, "-m", "probformer", "train", "--config", str(config), "--out", str(run), "--resume"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith(f"probformer train: error: {damaged}") and len(result.stderr.splitlines()) == 1
