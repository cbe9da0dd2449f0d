"""The convergence study's set-up and turns (the runs themselves are a benchmark): its
overrides make a valid run config with early stopping on every epoch, and every turn's CPU
time is counted, a killed one's included."""

import pytest

from benchmarks import convergence
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


@pytest.mark.parametrize("until", [1, convergence.MAX_EPOCHS - 1, convergence.MAX_EPOCHS])
def test_a_turn_is_stopped_at_its_epoch_checkpoint_but_never_at_the_runs_last(tmp_path, until):
    """The trainer writes the last step's checkpoint before its final validation: a turn
    stopped there would lose that validation, and each turn after it would resume at the
    checkpoint and be stopped again at once (a loop with no epoch ever added)."""
    turn = busy_turn(tmp_path / "run", "while True: pass")
    turn.until = until
    (turn.run / "checkpoints").mkdir()
    (turn.run / "checkpoints" / "latest").write_text(f"step-{until * turn.per_epoch:07d}\n")
    assert turn.at_epoch_checkpoint() is (until < convergence.MAX_EPOCHS)
    turn.stop()


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
