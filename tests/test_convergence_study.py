"""The convergence study's set-up and report logic (the runs themselves are a benchmark):
its overrides make a valid run config with early stopping on every epoch, and the
crossing point is found where the sign of the gap changes."""

import json
import math
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks import convergence
from benchmarks.convergence_report import crossing, mean_curve
from probformer.training import run_config


@pytest.mark.parametrize("config", ["pt-small", "bert-small", "ut-small"])
def test_each_run_is_a_valid_config_with_early_stopping_every_epoch(config):
    loaded = run_config.load(f"configs/{config}.toml", convergence.overrides(config, seed=1, per_epoch=1315))
    train = loaded.train
    assert (train.eval_every, train.checkpoint_every, train.patience) == (1315, 1315, convergence.PATIENCE)
    assert train.epochs == convergence.MAX_EPOCHS and train.eval_sentences == 0 and train.threads == 1
    assert train.lr == convergence.tuned_lr(config) and train.seed == 1 and train.hold_freed_memory


def test_an_arm_with_a_rate_trains_at_that_rate_in_a_folder_of_its_own():
    arms = convergence.parse_arms("pt,bert,pt@0.01")
    assert [arm.name for arm in arms] == ["pt-small", "bert-small", "pt-small-lr0.01"]
    assert [arm.learning_rate for arm in arms] == [
        convergence.tuned_lr("pt-small"),
        convergence.tuned_lr("bert-small"),
        0.01,
    ]
    fixed = arms[2]
    loaded = run_config.load("configs/pt-small.toml", convergence.overrides(fixed.config, 0, 1315, fixed.lr))
    assert loaded.train.lr == 0.01 and loaded.train.patience == convergence.PATIENCE
    argv = convergence.command(fixed.config, 0, 1315, convergence.ROOT / "pt-small-lr0.01-s0", fixed.lr)
    assert "train.lr=0.01" in argv and argv[argv.index("--config") + 1] == "configs/pt-small.toml"
    second = [arm.name for arm in convergence.parse_arms(convergence.ARMS)][3:]
    assert second == ["pt-small-lr0.01", "bert-small-lr0.001", "ut-small-lr0.001"]  # each model at a lower rate


@pytest.mark.parametrize(
    "bad",
    ["gpt", "pt@", "pt@fast", "pt@0", "pt@-0.1", "pt@inf", "pt@nan", "pt,,bert", "pt,pt", "pt@0.01,pt@0.010000001"],
)
def test_a_bad_arm_is_refused_naming_the_allowed_forms(bad):
    with pytest.raises(SystemExit, match="--models"):
        convergence.parse_arms(bad)


def test_the_crossing_is_where_the_gap_changes_sign():
    # gaps 100, 5, -10: the sign flips after epoch 2
    assert crossing([100.0, 90.0, 80.0], [200.0, 95.0, 70.0]) == (
        "the curves cross between epochs 2 and 3; the baseline is ahead at epoch 3; "
        "gap (baseline − PT) from epoch 2 on: +5.0, -10.0"
    )
    # gaps 100, -5, 3, 4: crossed twice, PT ahead again at the end
    text = crossing([100.0, 90.0, 80.0, 70.0], [200.0, 85.0, 83.0, 74.0])
    assert text.startswith("the curves cross between epochs 1 and 2, then between epochs 2 and 3; PT is ahead")
    assert text.endswith("from epoch 1 on: +100.0, -5.0, +3.0, +4.0")
    text = crossing([100.0, 90.0, 80.0, 75.0], [200.0, 150.0, 110.0, 90.0])
    assert text.startswith("no crossing in 4 common epoch(s)")
    # gaps 100, 60, 30, 15: shrinking by (60 - 15) / 2 = 22.5 per epoch, closed in ceil(15 / 22.5) = 1 more
    assert "shrinking by 22.5 per epoch" in text and "near epoch 5" in text
    assert crossing([], [1.0]) == "no common epoch yet"


def test_each_seed_crossing_is_read_from_that_seeds_curves_alone():
    from benchmarks.convergence_report import seed_by_seed

    rows = [
        {"config": "pt", "seed": 0, "curve": [100.0, 90.0, 80.0]},
        {"config": "bert", "seed": 0, "curve": [200.0, 95.0, 70.0]},  # gaps 100, 5, -10
        {"config": "pt", "seed": 1, "curve": [100.0, 90.0]},
        {"config": "bert", "seed": 1, "curve": [200.0, 95.0, 1.0]},  # seed 1's PT has 2 epochs
    ]
    assert (
        seed_by_seed(rows, "pt", "bert") == "s0 2-3 (gap -10.0 at epoch 3); s1 none in 2 epoch(s) (gap +5.0 at epoch 2)"
    )
    assert seed_by_seed([{"config": "pt", "seed": 0, "curve": []}], "pt", "bert") == "s0 none in 0 epoch(s)"


def test_a_mean_cut_by_a_diverged_seed_says_so():
    from benchmarks.convergence_report import divergence_note

    rows = [
        {"config": "pt", "seed": 0, "diverged_at": 13},
        {"config": "pt", "seed": 1, "diverged_at": None},
        {"config": "bert", "seed": 0, "diverged_at": 2},
    ]
    assert divergence_note(rows, "pt") == "; s0 diverged at epoch 13: the mean stops before it"
    assert divergence_note(rows[1:2], "pt") == ""


def test_the_mean_curve_stops_before_a_seed_diverged():
    rows = [
        {"config": "pt-small", "curve": [10.0, 8.0, 1e40, 1e30], "diverged_at": 3},
        {"config": "pt-small", "curve": [12.0, 6.0, 5.0, 4.0], "diverged_at": None},
    ]
    assert mean_curve(rows, "pt-small") == [11.0, 7.0]


def test_no_mean_over_seeds_while_a_seed_has_no_curve():
    """A mean over the seeds that have curves would be one seed's curve under the mean's name."""
    rows = [{"config": "pt-small", "curve": [10.0, 8.0]}, {"config": "pt-small", "curve": []}]
    assert mean_curve(rows, "pt-small") == []


def test_the_recipe_reads_what_every_run_records():
    from benchmarks.convergence_report import shared

    rows = [{"warmup_steps": 100, "batch_size": 32}, {"warmup_steps": None, "batch_size": None}]
    assert (shared(rows, "warmup_steps"), shared(rows, "batch_size")) == ("100", "32")
    assert shared([{"lr": 0.01}, {"lr": 0.03}], "lr") == "per run" and shared(rows[1:], "batch_size") == "not started"


def test_the_mean_curve_stops_at_the_shortest_seed():
    rows = [
        {"config": "pt-small", "curve": [10.0, 8.0, 7.0]},
        {"config": "pt-small", "curve": [12.0, 6.0]},
        {"config": "bert-small", "curve": [1.0]},
    ]
    assert mean_curve(rows, "pt-small") == [11.0, 7.0]
    assert mean_curve(rows, "ut-small") == []


def test_the_ranking_is_read_against_the_papers():
    from benchmarks.convergence_report import against_the_paper

    text = against_the_paper([600.0, 500.0], [650.0, 400.0])
    assert text.startswith("PT: at epoch 2, BERT is ahead (500.0 PT vs 400.0 BERT): this agrees with")
    assert against_the_paper([300.0], [400.0], "pt-small-lr0.01").startswith("pt-small-lr0.01: at epoch 1, PT")
    assert "PT is ahead" in against_the_paper([300.0], [400.0]) and "reverse" in against_the_paper([300.0], [400.0])


def test_the_section_replaces_only_what_lies_between_its_markers(tmp_path, monkeypatch):
    from benchmarks import convergence_report

    page = tmp_path / "benchmarks.md"
    page.write_text("# Benchmarks\n\nearlier section\n")
    monkeypatch.setattr(convergence_report, "DOC", page)
    convergence_report.write_section("first report")
    convergence_report.write_section("second report")
    text = page.read_text()
    assert text.startswith("# Benchmarks\n\nearlier section\n")
    assert text.count(convergence_report.HEADING) == 1 and "second report" in text and "first report" not in text


@given(st.lists(st.floats(-1e3, 1e3).filter(lambda g: g != 0.0), min_size=1, max_size=40))
def test_the_crossings_are_the_sign_flips_and_their_count_gives_the_final_leader(gaps):
    from benchmarks.convergence_report import sign_changes

    flips = sign_changes(gaps)
    assert all((gaps[e] < 0) == (gaps[e - 1] > 0) for e in flips)
    assert all((gaps[e] < 0) == (gaps[e - 1] < 0) for e in range(1, len(gaps)) if e not in flips)
    # an odd number of crossings, and only then, leaves the other model ahead
    assert (len(flips) % 2 == 1) == ((gaps[0] > 0) != (gaps[-1] > 0))


@given(st.lists(st.floats(1.0, 1e4), min_size=1, max_size=30), st.integers(0, 29), st.floats(10.5, 1e40))
def test_a_run_diverges_at_the_first_epoch_ten_times_worse_than_its_best_before(points, at, factor):
    from benchmarks.convergence_report import diverged_at

    steady = [min(points[: i + 1]) for i in range(len(points))]  # never worse than before: no divergence
    assert diverged_at(steady) is None
    if at < len(steady):
        spiked = steady[:at] + [factor * min(steady[: at or 1])] + steady[at:]
        assert diverged_at(spiked) == (at + 1 if at else None)  # the first epoch has nothing before it


def test_perplexities_past_a_million_print_as_powers_of_ten():
    from benchmarks.convergence_report import ppl

    assert ppl(282.64) == "282.6" and ppl(2.1309e40) == "2.13e+40"
    assert ppl(-5.25, signed=True) == "-5.2" and ppl(-2.13e40, signed=True) == "-2.13e+40"


def _write_run(run, perplexities, per_epoch, stopped_early, finished):
    """A run folder as the trainer leaves it: train lines, a periodic validation after every
    epoch but on the run's last step (MAX_EPOCHS epochs: there it validates once, as its
    final line), the final line and summary.json once finished."""
    run.mkdir(parents=True, exist_ok=True)
    lines = []
    for epoch, value in enumerate(perplexities, start=1):
        step = epoch * per_epoch
        lines.append({"step": step, "split": "train", "loss": 5.0, "tokens_per_second": 1000.0 + epoch})
        if step < convergence.MAX_EPOCHS * per_epoch:
            lines.append({"step": step, "split": "valid", "loss": math.log(value), "perplexity": value})
    if finished:
        final = {"step": len(perplexities) * per_epoch, "split": "valid", "final": True}
        lines.append(final | {"loss": math.log(perplexities[-1]), "perplexity": perplexities[-1]})
        (run / "summary.json").write_text(json.dumps({"stopped_early": stopped_early}))
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


@given(st.lists(st.floats(1.0, 1e4), min_size=1, max_size=convergence.MAX_EPOCHS), st.booleans())
def test_the_curve_has_one_perplexity_per_epoch_trained_the_last_epoch_included(values, to_the_end):
    """A run that trains all MAX_EPOCHS epochs has no periodic validation on its last step,
    only the final one: the curve takes that as its last epoch (it was left out: 39 epochs,
    and a best and last perplexity without the 40th); an early-stopped run's final line
    repeats its last periodic one and adds no epoch."""
    from benchmarks.convergence_report import curve

    if to_the_end:
        values = (values * convergence.MAX_EPOCHS)[: convergence.MAX_EPOCHS]
    finished = to_the_end or len(values) > convergence.PATIENCE  # else in progress
    with tempfile.TemporaryDirectory() as folder:
        run = Path(folder) / "run"
        _write_run(run, values, 7, stopped_early=not to_the_end, finished=finished)
        assert curve(run) == values
        assert convergence.epochs_done(run) == len(values)


@given(st.integers(1, 10_000), st.sampled_from(["train", "valid"]))
def test_a_line_the_trainer_is_still_writing_is_no_record(cut, split):
    """The trainer appends a metrics line in two writes (and a kill can stop it between them),
    so a report read while the study runs can find a last line without its newline: it is
    not read (it was, and JSONDecodeError ended the report), as the trainer's resume drops it."""
    from benchmarks.convergence_report import curve, tokens_per_second

    with tempfile.TemporaryDirectory() as folder:
        run = Path(folder) / "run"
        _write_run(run, [300.0, 200.0, 150.0], 7, stopped_early=False, finished=False)
        whole = (convergence.records(run), curve(run), tokens_per_second(run), convergence.epochs_done(run))
        line = json.dumps({"step": 28, "split": split, "loss": 4.9, "perplexity": 134.3, "tokens_per_second": 9.0})
        with (run / "metrics.jsonl").open("a") as handle:
            handle.write(line[: cut % len(line)])
        assert (convergence.records(run), curve(run), tokens_per_second(run), convergence.epochs_done(run)) == whole


@given(st.lists(st.one_of(st.floats(1.0, 1e6), st.just(math.nan)), min_size=1, max_size=40))
def test_the_best_epoch_is_early_stoppings_and_a_nan_is_never_it(points):
    """The report's best epoch is the one the trainer's early stopping keeps (the first lowest
    loss, a NaN never an improvement); it took a NaN at epoch 1 as the best (min() keeps
    a NaN it starts from), and a NaN after a best was no divergence."""
    from benchmarks.convergence_report import best_epoch, diverged_at
    from probformer.training.early_stopping import EarlyStopping

    stopping = EarlyStopping(patience=0)
    for epoch, value in enumerate(points, start=1):
        stopping.update(math.log(value), epoch)
    assert best_epoch(points) == (stopping.best_step or None)
    first_nan = next((e for e, value in enumerate(points) if math.isnan(value)), None)
    if first_nan is not None and any(not math.isnan(value) for value in points[:first_nan]):
        assert diverged_at(points) is not None and diverged_at(points) <= first_nan + 1


def test_a_live_process_cpu_seconds_are_read_from_proc():
    """The oracle: os.times() of this process, which reads the same kernel counters."""
    import os
    import time

    from benchmarks.convergence import process_cpu_seconds

    end = time.process_time() + 0.05
    while time.process_time() < end:  # some CPU time to count
        pass
    before = os.times()
    seconds = process_cpu_seconds(os.getpid())
    after = os.times()
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert before.user + before.system - tick <= seconds <= after.user + after.system + tick
    assert process_cpu_seconds(2**22 + 12345) is None  # no such process


def test_a_turn_killed_with_its_worker_is_counted_up_to_its_last_poll(tmp_path):
    from benchmarks.convergence import add_cpu_seconds, read_cpu_seconds, record_in_flight, settle_in_flight
    from benchmarks.convergence_report import cpu_hours

    run = tmp_path / "run"
    run.mkdir()
    add_cpu_seconds(run, 3600.0)  # ended turns
    record_in_flight(run, 600.0)
    record_in_flight(run, 1800.0)  # the last poll before the kill
    assert read_cpu_seconds(run) == (3600.0, 1800.0) and cpu_hours(run) == 1.5  # the report counts it too
    settle_in_flight(run)  # the next start
    assert read_cpu_seconds(run) == (5400.0, 0.0)
    settle_in_flight(run)  # nothing left to settle: counted once
    add_cpu_seconds(run, 7.0)  # an ended turn replaces its own in-flight figure
    assert read_cpu_seconds(run) == (5407.0, 0.0) and sorted(p.name for p in run.iterdir()) == ["cpu_seconds.json"]


def busy_turn(run, code: str, turn_class=None):
    """A Turn around ``python -c code``, not a training run: no trainer needed."""
    import subprocess
    import sys

    from benchmarks.convergence import Turn

    turn = object.__new__(turn_class or Turn)
    run.mkdir(parents=True, exist_ok=True)
    turn.run, turn.until, turn.per_epoch, turn.reaped = run, 1, 10, False
    turn.log = open(run.parent / f"{run.name}.log", "a")  # noqa: SIM115 (closed when reaped)
    turn.process = subprocess.Popen([sys.executable, "-c", code])
    return turn


def test_a_turn_records_its_cpu_while_it_runs_and_exactly_when_stopped(tmp_path):
    import time

    from benchmarks.convergence import read_cpu_seconds

    turn = busy_turn(tmp_path / "run", "while True: pass")
    time.sleep(0.5)
    assert turn.poll() is False
    _, so_far = read_cpu_seconds(turn.run)
    assert so_far > 0
    turn.stop()
    total, in_flight = read_cpu_seconds(turn.run)
    assert in_flight == 0 and total >= so_far and turn.log.closed
    turn.stop()  # a second stop (the study's finally after the turn was reaped) does nothing
    assert read_cpu_seconds(turn.run) == (total, 0)


def test_a_failed_turn_stops_the_study_naming_it_and_every_other_turn_is_killed_and_counted(tmp_path, monkeypatch):
    """The failure is the error the study ends with; the turn beside it does not train on as an
    orphan; both are counted and worker.pid is removed."""
    import os
    import time

    from benchmarks import convergence

    codes = {"fails": "import time, sys; time.sleep(0.3); sys.exit(3)", "busy": "while True: pass"}
    started, real_turn = [], convergence.Turn

    class Arm:
        def __init__(self, name):
            self.name, self.config = name, "unused"

        def folder(self, seed):
            return tmp_path / f"{self.name}-s{seed}"

    def turn(arm, seed, per_epoch, slice_epochs):
        started.append(busy_turn(arm.folder(seed), codes[arm.name], real_turn))
        return started[-1]

    monkeypatch.setattr(convergence, "ROOT", tmp_path)
    monkeypatch.setattr(convergence, "Turn", turn)
    monkeypatch.setattr(convergence, "steps_per_epoch", lambda config: 10)
    pause = time.sleep
    monkeypatch.setattr(convergence.time, "sleep", lambda seconds: pause(0.05))  # polls every 5 s: faster here
    with pytest.raises(SystemExit, match=r"fails-s0 failed \(exit code 3\)"):
        convergence.study(1, 2, 1, [Arm("fails"), Arm("busy")])
    busy = next(t for t in started if t.run.name == "busy-s0")
    assert busy.reaped and not os.path.exists(f"/proc/{busy.process.pid}")
    assert all(convergence.read_cpu_seconds(t.run)[0] > 0 for t in started)
    assert not (tmp_path / "worker.pid").exists()
