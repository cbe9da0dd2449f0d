"""The training logs: metrics.csv mirrors metrics.jsonl row for row, TensorBoard holds the
same scalars, the gradient norm is the total norm before clipping (checked against the
gradients themselves), the learning rates follow the schedule per parameter group, the
per-layer diagnostics appear every ``diagnostics_every`` steps, a killed and resumed run
writes the same CSV as an uninterrupted one, and the progress display is a bar only on a
terminal."""

import csv
import io
import json
import math
import os
import signal

import numpy as np
import pytest
import torch

from probformer.training import crash_points, run_config
from probformer.training.run_log import WALL_CLOCK_KEYS, Progress
from probformer.training.trainer import Trainer, train
from tests.processes import fork_context

TINY = """
[model]
kind = "{kind}"
{model}
dropout = 0.0

[data]
source = "ptb"
task = "mlm"
train_sentences = 24
valid_sentences = 8
max_length = 90
vocabulary = 200

[train]
batch_size = 8
lr = 3e-3
warmup_steps = 2
steps = 5
clip = {clip}
eval_every = 2
eval_sentences = 4
log_every = 2
diagnostics_every = 3
checkpoint_every = 1
threads = 1
"""


PT = "labels = 8\nchannels = 2\nrank = 2\niterations = 2\nmup = true"


PARTICLE = "width = 16\nheads = 2\nlayers = 2\nffn_width = 32"


def write_config(folder, kind="probabilistic_transformer", model=PT, clip=1e-3):
    path = folder / "tiny.toml"
    path.write_text(TINY.format(kind=kind, model=model, clip=clip))
    return path


def jsonl(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def csv_rows(run) -> list[dict]:
    with (run / "metrics.csv").open() as handle:
        return list(csv.DictReader(handle))


def parsed(row: dict) -> dict:
    """A CSV row as the JSON record it must equal: empty cells absent, numbers as numbers."""
    record = {}
    for key, cell in row.items():
        if cell == "":
            continue
        if key == "split":
            record[key] = cell
        elif key == "final":
            record[key] = bool(int(cell))
        else:
            number = float(cell)
            record[key] = int(cell) if cell.lstrip("-").isdigit() else number
    return record


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """A 5-step PT run whose gradients are recorded (before clipping) at every step."""
    folder = tmp_path_factory.mktemp("logs")
    trainer = Trainer(run_config.load(write_config(folder)), folder / "run", progress=False)
    norms, squares = [], []

    def record(parameter):  # after accumulation, before clip_grad_norm_ scales the gradient
        squares.append(float(parameter.grad.double().pow(2).sum()))

    handles = [p.register_post_accumulate_grad_hook(record) for p in trainer.model.parameters()]
    step = trainer.optimizer.step

    def stepping(*args, **kwargs):  # one optimiser step: the squares of this step are complete
        norms.append(math.sqrt(math.fsum(squares)))
        squares.clear()
        return step(*args, **kwargs)

    trainer.optimizer.step = stepping
    trainer.run()
    for handle in handles:
        handle.remove()
    return folder / "run", trainer, norms


def test_the_csv_is_the_json_lines_row_for_row(logged_run):
    run, _, _ = logged_run
    records, rows = jsonl(run), csv_rows(run)
    assert [parsed(row) for row in rows] == records  # same floats, exactly (repr round trip)
    keys = [(r["step"], r["split"]) for r in records]
    assert len(keys) == len(set(keys))  # one row per logged step and split
    assert [k for k in keys if k[1] == "train"] == [(2, "train"), (3, "train"), (4, "train"), (5, "train")]


def test_the_gradient_norm_is_the_total_norm_before_clipping(logged_run):
    run, _, norms = logged_run
    train_lines = [r for r in jsonl(run) if r["split"] == "train"]
    assert len(norms) == 5
    for line in train_lines:
        assert line["grad_norm"] == pytest.approx(norms[line["step"] - 1], rel=1e-5)
        assert line["grad_norm"] > 1e-3  # clip = 1e-3: these are norms before clipping


def test_the_learning_rates_follow_the_schedule_per_group(logged_run):
    run, trainer, _ = logged_run
    # warm-up over 2 steps, then linear decay to 0 over the remaining 3: factor of step index s
    factors = {0: 0.5, 1: 1.0, 2: 1.0, 3: 2 / 3, 4: 1 / 3}
    multipliers = {g["name"]: g["lr_multiplier"] for g in trainer.optimizer.param_groups}
    assert len(multipliers) >= 3
    for line in (r for r in jsonl(run) if r["split"] == "train"):
        factor = factors[line["step"] - 1]
        assert line["lr"] == pytest.approx(3e-3 * factor, rel=1e-12)
        for name, multiplier in multipliers.items():
            assert line[f"lr/{name}"] == pytest.approx(3e-3 * multiplier * factor, rel=1e-12)


def test_tokens_and_throughput(logged_run):
    run, trainer, _ = logged_run
    from probformer.training.corpus import epoch_order

    order = epoch_order(trainer.lengths, 8, 0, 0)  # 24 sentences, batch 8: 3 batches an epoch
    order += epoch_order(trainer.lengths, 8, 0, 1)
    real = [sum(len(trainer.corpus.train[i][0]) for i in batch) for batch in order[:5]]
    for line in (r for r in jsonl(run) if r["split"] == "train"):
        assert line["tokens"] == sum(real[: line["step"]])
        assert line["tokens_per_second"] > 0


def test_per_layer_diagnostics_every_n_steps_and_at_the_end(logged_run):
    run, trainer, _ = logged_run
    columns = csv_rows(run)[0].keys()
    probe = [c for c in columns if "/iteration_" in c]
    # the PT's depth dim is "iteration": one column per measure and mean-field iteration (2)
    by_measure = {}
    for column in probe:
        measure, _, index = column.partition("/iteration_")
        by_measure.setdefault(measure, []).append(int(index))
    assert by_measure == {"ess": [0, 1], "cosine": [0, 1], "effective_rank": [0, 1]}
    for line in (r for r in jsonl(run) if r["split"] == "train"):
        has = any(key in line for key in probe)
        assert has == (line["step"] in (3, 5)), line  # every 3 steps and at the last
        if has:
            assert all(0 < line[f"ess/iteration_{i}"] <= 1 + 1e-12 for i in by_measure["ess"])
            assert all(-1 <= line[f"cosine/iteration_{i}"] <= 1 for i in by_measure["cosine"])


def test_the_last_probe_equals_the_report_of_the_final_model(logged_run):
    """The trainer's probe and ``diagnostics.report`` on the saved final model agree."""
    from probformer import diagnostics
    from probformer.training import checkpoint
    from probformer.training.corpus import collate

    run, trainer, _ = logged_run
    model, _ = checkpoint.load(run / "model")
    tokens, mask, _ = collate(trainer.corpus.valid[:8])
    report = diagnostics.report(model, tokens, mask)
    means = diagnostics.layer_means(report)
    last = [r for r in jsonl(run) if r["split"] == "train"][-1]
    for index, value in enumerate(means["received_ess"]):
        assert last[f"ess/iteration_{index}"] == pytest.approx(value, rel=1e-9)
    # the oracle of the mean: every sentence's ESS of the received mass, by hand
    attention = report["sample_stats"]["attention_received"].values[0, :, 0]  # [draw, channel, token]
    by_hand = []
    for sentence in range(attention.shape[0]):
        for channel in range(attention.shape[1]):
            w = attention[sentence, channel][np.isfinite(attention[sentence, channel])]
            by_hand.append(w.sum() ** 2 / (w**2).sum() / len(w))
    assert last["ess/iteration_0"] == pytest.approx(np.mean(by_hand), rel=1e-9)


def test_tensorboard_holds_the_same_scalars(logged_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _, _ = logged_run
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/grad_norm", "train/tokens_per_second", "valid/loss", "train/ess/iteration_0"} <= tags
    for split in ("train", "valid"):
        expected = [(r["step"], r["loss"]) for r in jsonl(run) if r["split"] == split]
        found = [(e.step, e.value) for e in events.Scalars(f"{split}/loss")]
        assert [s for s, _ in found] == [s for s, _ in expected]
        np.testing.assert_allclose([v for _, v in found], [v for _, v in expected], rtol=1e-6)  # float32


def killed_at(point, config, run):
    os.environ[crash_points.ENVIRONMENT] = point
    train(config, run, progress=False)


def test_a_killed_and_resumed_run_writes_the_same_csv(tmp_path):
    config = write_config(tmp_path, kind="particle_transformer", model=PARTICLE, clip=1.0)
    train(config, tmp_path / "full", progress=False)
    child = fork_context().Process(target=killed_at, args=("metrics:partial@4", config, tmp_path / "run"))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == -signal.SIGKILL
    train(config, tmp_path / "run", resume=True, progress=False)
    full, resumed = csv_rows(tmp_path / "full"), csv_rows(tmp_path / "run")
    assert [list(row) for row in resumed] == [list(row) for row in full]  # the same header

    def timeless(rows):
        return [{k: v for k, v in row.items() if k not in WALL_CLOCK_KEYS} for row in rows]

    assert timeless(resumed) == timeless(full)
    assert any(k.startswith("smc_ess/layer_") for k in full[0])  # the Particle Transformer's SMC weights


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_is_a_bar_on_a_terminal_and_plain_lines_otherwise():
    plain = io.StringIO()
    progress = Progress(total=40, initial=0, enabled=True, every=3, stream=plain)
    for step in range(2, 41, 2):  # a logged training line every 2 steps
        progress.step(1.0, 100.0)
        progress.train_line({"step": step, "loss": 1.0, "grad_norm": 0.5, "tokens_per_second": 100.0})
    progress.close()
    lines = plain.getvalue().splitlines()
    # every third logged line (steps 6, 12, ..., 36) and the last step
    assert [line.split(":")[0] for line in lines] == [f"step {s}/40" for s in (6, 12, 18, 24, 30, 36, 40)]
    assert "\r" not in plain.getvalue()
    terminal = Terminal()
    bar = Progress(total=4, initial=0, enabled=True, stream=terminal)
    for step in range(1, 5):
        bar.step(1.0, None)
        bar.train_line({"step": step, "loss": 1.0})
    bar.close()
    assert "\r" in terminal.getvalue() and "4/4" in terminal.getvalue()  # a tqdm bar
    silent = io.StringIO()
    Progress(total=4, initial=0, enabled=False, stream=silent).train_line({"step": 4, "loss": 1.0})
    assert silent.getvalue() == ""


def test_the_probe_of_a_diverged_model_is_nan_not_an_error():
    """Non-finite weights: every probe field NaN, so the trainer's own check names the step."""
    import probformer as pf
    from probformer.diagnostics.probe import layer_metrics

    torch.manual_seed(0)
    model = pf.ParticleTransformer(pf.ParticleConfig(vocab_size=30, width=16, heads=2, layers=2, ffn_width=32))
    tokens, mask = torch.randint(1, 30, (2, 6)), torch.ones(2, 6, dtype=torch.bool)
    names = list(layer_metrics(model, tokens, mask))
    assert names == [f"{m}/layer_{i}" for m in ("ess", "smc_ess", "cosine", "effective_rank") for i in (0, 1)]
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] = math.nan
    found = layer_metrics(model, tokens, mask, names=names)
    assert list(found) == names and all(math.isnan(v) for v in found.values())


@pytest.mark.parametrize("steps,note", [(1, "rises to 50% of train.lr and never decays"), (8, None)])
def test_a_warm_up_longer_than_the_run_is_said_as_the_run_starts(tmp_path, steps, note):
    """The tiny run warms up over 2 steps: a 1-step run reaches half the rate."""
    from probformer.training.run_log import start_messages
    from probformer.training.trainer import Trainer
    from tests.builders import write_tiny_run_config

    trainer = Trainer(run_config.load(write_tiny_run_config(tmp_path, steps=steps)), tmp_path / "run", progress=False)
    lines = start_messages(trainer)
    assert lines[0].startswith("probabilistic_transformer: ") and f"; {steps} steps; 1 process(es)" in lines[0]
    notes = [line for line in lines if line.startswith("note: train.warmup_steps = 2")]
    if note is None:
        assert notes == []
    else:
        assert len(notes) == 1 and note in notes[0]


@pytest.mark.parametrize("max_length, counted", [(90, "sentences"), (6, "examples")])
def test_the_start_line_counts_windows_as_examples_when_sentences_are_cut(tmp_path, max_length, counted):
    """With long sentences cut into windows the counts are of windows: the line said
    "sentences" for them (272 "sentences" where the text had 190)."""
    from probformer.training.run_log import start_messages
    from probformer.training.trainer import Trainer
    from tests.builders import write_tiny_run_config

    path = write_tiny_run_config(tmp_path, max_length=max_length)
    path.write_text(path.read_text().replace("[data]", '[data]\nlong_sentences = "windows"'))
    trainer = Trainer(run_config.load(path), tmp_path / "run", progress=False)
    first = start_messages(trainer)[0]
    expected = f"{len(trainer.corpus.train)} training / {len(trainer.corpus.valid)} validation {counted}"
    assert expected in first
    assert (len(trainer.corpus.valid) > 24) == (counted == "examples")  # 24 PTB sentences: windows only when cut
