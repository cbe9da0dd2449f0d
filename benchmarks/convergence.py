"""Does PT's one-epoch lead survive to convergence? PT vs BERT vs UT (small size, PTB
MLM), each at its tuned learning rate, trained until the validation loss has not improved
for PATIENCE epochs (at most MAX_EPOCHS).

    .venv/bin/python -m benchmarks.convergence                # run / resume the study
    .venv/bin/python -m benchmarks.convergence --workers 2    # two runs side by side
    .venv/bin/python -m benchmarks.convergence --models pt,bert,ut,pt@0.01   # arms: model[@lr]
    .venv/bin/python -m benchmarks.convergence_report         # the table, the plot, the claim

The recipe, stated in the table: the model's config (configs/<model>-small.toml) with
its learning rate from the tuned sweep (docs/benchmarks/ptb_lr_sweep.json), linear
warm-up over the config's warm-up steps, then linear decay to 0 at MAX_EPOCHS epochs;
validation on the whole PTB validation set at the end of every epoch; early stopping
(``train.patience``) after PATIENCE epochs without a new best validation loss; one torch
thread per run.

An arm ``model@lr`` trains the model at a fixed learning rate instead of the sweep's. The
default study gives every model a second arm at the sweep grid's next lower rate (``pt@0.01``,
``bert@0.001``, ``ut@0.001``): the tuned rates were chosen for a one-epoch decay, and a
40-epoch decay may favour a lower one, for each model alike.

Resumable across sessions: each run lives in runs/convergence/<arm>-s<seed>/ and
continues from its last checkpoint through the trainer's exact resume (a kill changes no
number). Runs advance in turns of --slice epochs, the run with the fewest epochs first,
so a partial study has every curve at about the same length; a turn ends right after an
epoch's checkpoint is written. The worker processes share one process group, whose id
(negated, for ``kill -STOP``/``kill -CONT``) is in runs/convergence/worker.pid while they
run. A run's cpu_seconds.json holds the CPU seconds of its ended turns (each exact, from the
reaped process) and, as ``in_flight``, what its running turn has used so far (read from
/proc at every poll): a turn killed with its worker (the end of a session) is counted up to
its last poll, which the next start adds to the total.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

MODELS = ("pt", "bert", "ut")
ARMS = "pt,bert,ut,pt@0.01,bert@0.001,ut@0.001"
MAX_EPOCHS = 40
PATIENCE = 3
ROOT = Path("runs/convergence")
SWEEP = Path("docs/benchmarks/ptb_lr_sweep.json")
PLOT = Path("docs/benchmarks/convergence.png")
RESULTS = Path("docs/benchmarks/convergence.json")
CPU_SECONDS = "cpu_seconds.json"  # per run: the ended turns' CPU seconds and the running one's so far


def tuned_lr(config: str) -> float:
    """The best learning rate of the tuned one-epoch sweep (seed 0) for ``config``."""
    runs = [r for r in json.loads(SWEEP.read_text())["runs"] if r["config"] == config and r["seed"] == 0]
    if not runs:
        raise SystemExit(f"{SWEEP} has no seed-0 run of {config}: run benchmarks/lr_sweep.py first")
    return min(runs, key=lambda r: r["valid_perplexity"])["lr"]


@dataclass(frozen=True)
class Arm:
    """One line of the study: a model's small config at the sweep's tuned lr, or at ``lr``."""

    model: str
    lr: float | None = None

    @property
    def config(self) -> str:
        return f"{self.model}-small"

    @property
    def name(self) -> str:
        return self.config if self.lr is None else f"{self.config}-lr{self.lr:g}"

    @property
    def learning_rate(self) -> float:
        return tuned_lr(self.config) if self.lr is None else self.lr

    def folder(self, seed: int) -> Path:
        """Where the run of this arm and ``seed`` lives."""
        return ROOT / f"{self.name}-s{seed}"


def parse_arms(text: str) -> list[Arm]:
    """``"pt,bert,pt@0.01"`` -> arms; a clear error naming the bad part and the allowed forms."""
    arms = []
    for part in text.split(","):
        model, at, lr = part.strip().partition("@")
        try:
            rate = float(lr) if at else None
        except ValueError:
            rate = math.nan
        if model not in MODELS or (rate is not None and not (math.isfinite(rate) and rate > 0)):
            raise SystemExit(f"--models: {part!r} is not MODEL or MODEL@LR with MODEL one of {list(MODELS)} "
                             "and LR a positive number (e.g. pt,bert,ut,pt@0.01)")  # fmt: skip
        arms.append(Arm(model, rate))
    if len({arm.name for arm in arms}) != len(arms):  # one run folder per arm
        raise SystemExit(f"--models names an arm twice: {text!r}")
    return arms


def steps_per_epoch(config: str) -> int:
    from probformer.training import run_config
    from probformer.training.corpus import prepare_corpus

    loaded = run_config.load(Path("configs") / f"{config}.toml")
    return math.ceil(len(prepare_corpus(loaded.data).train) / loaded.train.batch_size)


def overrides(config: str, seed: int, per_epoch: int, lr: float | None = None) -> list[str]:
    return [
        f"train.lr={tuned_lr(config) if lr is None else lr}",
        f"train.seed={seed}",
        f"train.epochs={MAX_EPOCHS}",
        f"train.eval_every={per_epoch}",
        "train.eval_sentences=0",
        f"train.patience={PATIENCE}",
        f"train.checkpoint_every={per_epoch}",
        "train.diagnostics_every=0",
        "train.threads=1",
        "train.hold_freed_memory=true",  # a process of its own: freed memory is reused, not re-faulted
    ]


def command(config: str, seed: int, per_epoch: int, run: Path, lr: float | None = None) -> list[str]:
    sets = [part for assignment in overrides(config, seed, per_epoch, lr) for part in ("--set", assignment)]
    resume = ["--resume"] if (run / "checkpoints" / "latest").is_file() else []
    train = [sys.executable, "-m", "probformer", "train", "--config", f"configs/{config}.toml"]
    return [*train, *sets, "--out", str(run), *resume]


def records(run: Path) -> list[dict]:
    """The lines of a run's metrics.jsonl, but a last one without its newline: the trainer
    writes a line in two parts, and a run in progress (or killed between them) can hold
    the first alone; its resume drops it, and so does this."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    complete = path.read_text().split("\n")[:-1]
    return [json.loads(line) for line in complete if line.strip()]


def epoch_validations(run: Path) -> list[dict]:
    """One validation line per epoch trained: the periodic (end-of-epoch) ones, and the final
    one where it is later than they are. The trainer validates periodically at the end of
    every epoch but the run's last (MAX_EPOCHS epochs), where its final validation is that
    epoch's; an early-stopped run's final line repeats its last periodic one (same step)."""
    lines = [r for r in records(run) if r["split"] == "valid"]
    periodic = [r for r in lines if not r.get("final")]
    final = [r for r in lines if r.get("final")]
    if final and (not periodic or final[-1]["step"] > periodic[-1]["step"]):
        periodic.append(final[-1])
    return periodic


def finished(run: Path) -> bool:
    return (run / "summary.json").is_file()


def epochs_done(run: Path) -> int:
    return len(epoch_validations(run))


def read_cpu_seconds(run: Path) -> tuple[float, float]:
    """``(ended turns' CPU seconds, the running turn's so far)`` from the run's cpu_seconds.json."""
    path = run / CPU_SECONDS
    if not path.is_file():
        return 0.0, 0.0
    record = json.loads(path.read_text())
    return record["cpu_seconds"], record.get("in_flight", 0.0)


def _write_cpu_seconds(run: Path, total: float, in_flight: float) -> None:
    """One file, replaced whole: a kill or a reader never sees half of it, nor a figure in two places."""
    temporary = run / (CPU_SECONDS + ".tmp")
    temporary.write_text(json.dumps({"cpu_seconds": total, "in_flight": in_flight}))
    os.replace(temporary, run / CPU_SECONDS)


def add_cpu_seconds(run: Path, seconds: float) -> None:
    """An ended turn's exact CPU seconds; its in-flight figure, now counted, is cleared."""
    total, _ = read_cpu_seconds(run)
    _write_cpu_seconds(run, total + seconds, 0.0)


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds a live process has used, from /proc (Linux; None elsewhere):
    fields 14 and 15 of /proc/<pid>/stat, counted after the command name's closing bracket."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def record_in_flight(run: Path, seconds: float | None) -> None:
    """What the running turn has used so far."""
    if seconds is not None:
        _write_cpu_seconds(run, read_cpu_seconds(run)[0], seconds)


def settle_in_flight(run: Path) -> None:
    """A turn killed with its worker left its CPU seconds up to its last poll: into the total."""
    total, in_flight = read_cpu_seconds(run)
    if in_flight:
        _write_cpu_seconds(run, total + in_flight, 0.0)


class Turn:
    """One worker process training one run until its next epoch checkpoint (or the end)."""

    def __init__(self, arm: Arm, seed: int, per_epoch: int, slice_epochs: int):
        self.run = arm.folder(seed)
        self.run.parent.mkdir(parents=True, exist_ok=True)
        self.until = epochs_done(self.run) + slice_epochs
        self.per_epoch = per_epoch
        environment = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        self.log = open(self.run.parent / f"{self.run.name}.log", "a")  # noqa: SIM115 (closed when reaped)
        self.reaped = False
        self.process = subprocess.Popen(
            command(arm.config, seed, per_epoch, self.run, arm.lr),
            env=environment,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        print(f"{self.run.name}: epochs {epochs_done(self.run)} -> {self.until} (pid {self.process.pid})", flush=True)

    def at_epoch_checkpoint(self) -> bool:
        """The turn's last epoch is checkpointed and validated: stopping it loses nothing. The
        run's last epoch (MAX_EPOCHS) is never so: its validation is the final one, written
        after its checkpoint, and the run ends by itself."""
        if self.until >= MAX_EPOCHS:
            return False
        pointer = self.run / "checkpoints" / "latest"
        if not pointer.is_file():
            return False
        step = int(pointer.read_text().strip().removeprefix("step-") or 0)
        return step >= self.until * self.per_epoch

    def poll(self) -> bool:
        """True when the turn is over (the process ended, or was stopped at its checkpoint)."""
        pid, status, usage = os.wait4(self.process.pid, os.WNOHANG)
        if pid == 0:  # still training
            if not self.at_epoch_checkpoint():
                record_in_flight(self.run, process_cpu_seconds(self.process.pid))
                return False
            os.kill(self.process.pid, signal.SIGKILL)  # its checkpoint is complete: nothing is lost
            _, status, usage = os.wait4(self.process.pid, 0)
        self.reaped = True  # by os.wait4 here, never by Popen (which would lose its usage)
        self.process.returncode = code = os.waitstatus_to_exitcode(status)
        add_cpu_seconds(self.run, usage.ru_utime + usage.ru_stime)
        self.log.close()
        if code not in (0, -signal.SIGKILL):
            raise SystemExit(f"{self.run.name} failed (exit code {code}); see {self.log.name}")
        return True

    def stop(self) -> None:
        """Kill a turn the study leaves (it stops), and count what it used."""
        if self.reaped:
            return
        try:
            os.kill(self.process.pid, signal.SIGKILL)
            _, _, usage = os.wait4(self.process.pid, 0)
            add_cpu_seconds(self.run, usage.ru_utime + usage.ru_stime)
        except (ProcessLookupError, ChildProcessError):  # reaped elsewhere: counted up to its last poll
            settle_in_flight(self.run)
        self.reaped = True
        self.log.close()


def study(seeds: int, workers: int, slice_epochs: int, arms: list[Arm]) -> None:
    per_epoch = steps_per_epoch(arms[0].config)  # the same data and batch size for every model
    queue = [(arm, seed) for seed in range(seeds) for arm in arms]
    ROOT.mkdir(parents=True, exist_ok=True)
    for arm, seed in queue:  # no turn runs yet: what a killed one left is settled
        settle_in_flight(arm.folder(seed))
    (ROOT / "worker.pid").write_text(f"-{os.getpgrp()}\n")
    running: list[Turn] = []
    try:
        while True:
            busy = {turn.run for turn in running}
            waiting = [(a, s) for a, s in queue if not finished(a.folder(s)) and a.folder(s) not in busy]
            while waiting and len(running) < workers:
                arm, seed = min(waiting, key=lambda a_s: (epochs_done(a_s[0].folder(a_s[1])), queue.index(a_s)))
                running.append(Turn(arm, seed, per_epoch, slice_epochs))
                waiting.remove((arm, seed))
            if not running:
                break
            time.sleep(5)
            for turn in list(running):  # a failure raises with the turns before it reaped and marked
                if turn.poll():
                    running.remove(turn)
    finally:
        for turn in running:
            turn.stop()
        (ROOT / "worker.pid").unlink(missing_ok=True)
    print("every run has finished", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=2, help="seeds per model (0, 1, ...)")
    parser.add_argument("--workers", type=int, default=1, help="runs trained side by side (one thread each)")
    parser.add_argument("--slice", type=int, default=1, help="epochs a run trains before yielding its worker")
    parser.add_argument("--models", default=ARMS, help="arms, MODEL or MODEL@LR, MODEL one of pt,bert,ut")
    args = parser.parse_args()
    arms = parse_arms(args.models)
    for name in ("seeds", "workers", "slice"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be at least 1, got {getattr(args, name)}")
    if os.getpgrp() != os.getpid():
        os.setpgrp()  # one group: kill -STOP -<group> pauses the workers too
    study(args.seeds, args.workers, args.slice, arms)


if __name__ == "__main__":
    main()
